// A one-shot parallel loop whose caller thread stays free to report progress.
//
// Thread/GIL contract: any number of threads may call at once. `task` runs on threads of a
// process-wide pool (never on the caller; each call's jobs start at once, whatever other calls
// are running) in the default floating-point environment, whatever the caller's or an earlier
// task's FTZ/DAZ/rounding mode; `tick` runs only on the calling thread, so a binding may reacquire the
// GIL inside it. The caller must not hold the GIL while calling parallel_for itself.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

namespace pyckpt {

// Runs task(index, worker_id) for every index in [0, n) on `workers` threads (0 = hardware
// concurrency; never more threads than tasks). While they run, the caller invokes tick()
// roughly every `interval`; if tick returns false or throws, the workers finish the task
// they are on, take no more, and parallel_for throws Cancelled (or tick's exception). If a
// task throws, the remaining tasks are abandoned and the first exception is rethrown.
void parallel_for(uint64_t n, unsigned workers, const std::function<void(uint64_t, unsigned)>& task,
                  const std::function<bool()>& tick, std::chrono::milliseconds interval);

unsigned resolve_workers(int64_t requested);

}  // namespace pyckpt

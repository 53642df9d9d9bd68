#include "parallel.hpp"

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cfenv>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "errors.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace pyckpt {

namespace {

// New threads inherit the creator's floating-point mode (torch.set_flush_denormal sets FTZ/DAZ),
// which would make dtype conversions depend on the caller; workers always use the default.
void use_default_float_environment() noexcept {
    std::fesetenv(FE_DFL_ENV);
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(0x1f80);  // round to nearest, all exceptions masked, no FTZ/DAZ
#endif
}

}  // namespace

unsigned resolve_workers(int64_t requested) {
    if (requested < 0) throw std::invalid_argument("workers must be >= 0 (0 means one per CPU)");
    if (requested == 0) {
        unsigned hc = std::thread::hardware_concurrency();
        return hc ? hc : 1;
    }
    // Beyond this the threads only contend; also keeps a typo from spawning millions.
    return requested > 1024 ? 1024u : static_cast<unsigned>(requested);
}

namespace {

// Process-wide worker threads that idle on a condition variable between calls, so a conversion
// that runs thousands of small parallel_for calls does not pay thread start-up for each.
//
// Each submitted job gets a thread at once: the pool grows until it has as many threads as jobs
// run or wait at the same time (the largest worker count asked for when calls do not overlap),
// so overlapping callers never queue behind each other and a cancelled call never waits for
// another call's work.
//
// The pool is never destroyed: its threads may still be finishing a daemon thread's job when
// the interpreter exits, and joining them there could hang exit; the process ending reclaims
// them. After fork() only the forking thread exists in the child, and the pool's mutex may be
// held by a thread that is gone, so a child abandons the parent's pool and starts its own.
class Pool {
public:
    struct Job {
        std::function<void()> run;
        std::function<void()> done;  // runs after the thread counts itself idle again
    };

    Pool() : pid_(::getpid()) {}
    pid_t pid() const noexcept { return pid_; }

    // Queues `jobs`, first starting threads so that every one of them runs at once. If a thread
    // cannot be started nothing is queued and the error propagates.
    void submit(std::vector<Job>& jobs) {
        {
            std::lock_guard<std::mutex> lk(mu_);
            const std::size_t spare = threads_ - busy_ - queue_.size();
            for (std::size_t k = spare; k < jobs.size(); ++k) {
                std::thread(&Pool::loop, this).detach();
                ++threads_;
            }
            for (Job& j : jobs) queue_.push_back(std::move(j));
        }
        cv_.notify_all();
    }

private:
    void loop() {
        std::unique_lock<std::mutex> lk(mu_);
        while (true) {
            cv_.wait(lk, [&] { return !queue_.empty(); });
            Job job = std::move(queue_.front());
            queue_.pop_front();
            ++busy_;
            lk.unlock();
            job.run();
            lk.lock();
            --busy_;
            lk.unlock();
            // Signalled only now, so a caller that submits again right after sees this thread
            // as spare instead of starting another one.
            job.done();
            job = Job{};
            lk.lock();
        }
    }

    const pid_t pid_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> queue_;
    std::size_t threads_ = 0;
    std::size_t busy_ = 0;
};

std::atomic<Pool*> g_pool{nullptr};

Pool& process_pool() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p && p->pid() == ::getpid()) return *p;
    // First use, or first use in a forked child: the parent's pool is left as it is (leaked).
    auto fresh = std::make_unique<Pool>();
    if (g_pool.compare_exchange_strong(p, fresh.get(), std::memory_order_acq_rel)) return *fresh.release();
    // Another thread installed one first; `p` now holds it.
    return *p;
}

// State shared by one parallel_for call and its jobs. Jobs hold it by shared_ptr, so their final
// unlock and notify never touch a caller frame that has already returned.
struct Shared {
    std::atomic<uint64_t> next{0};
    std::atomic<bool> stop{false};
    std::mutex mu;
    std::condition_variable cv;
    unsigned running = 0;
    std::exception_ptr first_error;
};

}  // namespace

void parallel_for(uint64_t n, unsigned workers, const std::function<void(uint64_t, unsigned)>& task,
                  const std::function<bool()>& tick, std::chrono::milliseconds interval) {
    if (n == 0) {
        if (tick && !tick()) throw Cancelled();
        return;
    }
    if (workers == 0) workers = 1;
    if (workers > n) workers = static_cast<unsigned>(n);

    auto sh = std::make_shared<Shared>();
    sh->running = workers;
    const auto* fn = &task;  // outlives the jobs: we wait for all of them below

    std::vector<Pool::Job> jobs;
    jobs.reserve(workers);
    for (unsigned wid = 0; wid < workers; ++wid) {
        Pool::Job j;
        j.run = [sh, fn, n, wid] {
            use_default_float_environment();
            try {
                while (!sh->stop.load(std::memory_order_relaxed)) {
                    uint64_t i = sh->next.fetch_add(1, std::memory_order_relaxed);
                    if (i >= n) break;
                    (*fn)(i, wid);
                }
            } catch (...) {
                std::lock_guard<std::mutex> lk(sh->mu);
                if (!sh->first_error) sh->first_error = std::current_exception();
                sh->stop.store(true);
            }
        };
        j.done = [sh] {
            std::lock_guard<std::mutex> lk(sh->mu);
            if (--sh->running == 0) sh->cv.notify_all();
        };
        jobs.push_back(std::move(j));
    }
    process_pool().submit(jobs);

    std::exception_ptr tick_error;
    bool cancelled = false;
    {
        std::unique_lock<std::mutex> lk(sh->mu);
        while (sh->running > 0) {
            if (sh->cv.wait_for(lk, interval, [&] { return sh->running == 0; })) break;
            if (!tick || cancelled || tick_error) continue;
            lk.unlock();
            try {
                if (!tick()) cancelled = true;
            } catch (...) {
                tick_error = std::current_exception();
            }
            if (cancelled || tick_error) sh->stop.store(true);
            lk.lock();
        }
    }
    if (tick_error) std::rethrow_exception(tick_error);
    if (cancelled) throw Cancelled();
    if (sh->first_error) std::rethrow_exception(sh->first_error);
}

}  // namespace pyckpt

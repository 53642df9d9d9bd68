#include "parallel.hpp"

#include <atomic>
#include <cfenv>
#include <condition_variable>
#include <exception>
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

void parallel_for(uint64_t n, unsigned workers, const std::function<void(uint64_t, unsigned)>& task,
                  const std::function<bool()>& tick, std::chrono::milliseconds interval) {
    if (n == 0) {
        if (tick && !tick()) throw Cancelled();
        return;
    }
    if (workers == 0) workers = 1;
    if (workers > n) workers = static_cast<unsigned>(n);

    std::atomic<uint64_t> next{0};
    std::atomic<bool> stop{false};
    std::mutex mu;
    std::condition_variable cv;
    unsigned running = workers;
    std::exception_ptr first_error;

    auto body = [&](unsigned wid) {
        use_default_float_environment();
        try {
            while (!stop.load(std::memory_order_relaxed)) {
                uint64_t i = next.fetch_add(1, std::memory_order_relaxed);
                if (i >= n) break;
                task(i, wid);
            }
        } catch (...) {
            std::lock_guard<std::mutex> lk(mu);
            if (!first_error) first_error = std::current_exception();
            stop.store(true);
        }
        std::lock_guard<std::mutex> lk(mu);
        if (--running == 0) cv.notify_all();
    };

    std::vector<std::thread> threads;
    threads.reserve(workers);
    try {
        for (unsigned w = 0; w < workers; ++w) threads.emplace_back(body, w);
    } catch (...) {
        // Could not start every thread: let the started ones drain and report the failure.
        stop.store(true);
        {
            std::lock_guard<std::mutex> lk(mu);
            running -= workers - static_cast<unsigned>(threads.size());
        }
        for (auto& t : threads) t.join();
        throw;
    }

    std::exception_ptr tick_error;
    bool cancelled = false;
    {
        std::unique_lock<std::mutex> lk(mu);
        while (running > 0) {
            if (cv.wait_for(lk, interval, [&] { return running == 0; })) break;
            if (!tick || cancelled || tick_error) continue;
            lk.unlock();
            try {
                if (!tick()) cancelled = true;
            } catch (...) {
                tick_error = std::current_exception();
            }
            if (cancelled || tick_error) stop.store(true);
            lk.lock();
        }
    }
    for (auto& t : threads) t.join();
    if (tick_error) std::rethrow_exception(tick_error);
    if (cancelled) throw Cancelled();
    if (first_error) std::rethrow_exception(first_error);
}

}  // namespace pyckpt

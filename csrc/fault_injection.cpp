#include "fault_injection.hpp"

#include <atomic>

namespace pyckpt::fault_injection {

namespace {

struct Trigger {
    std::atomic<int> err{0};
    std::atomic<int64_t> left{0};
};

Trigger g_triggers[static_cast<int>(Call::Count)];

}  // namespace

bool parse_call(std::string_view name, Call& out) noexcept {
    static constexpr std::string_view names[] = {"open", "write", "fsync", "close"};
    for (int i = 0; i < static_cast<int>(Call::Count); ++i) {
        if (name == names[i]) {
            out = static_cast<Call>(i);
            return true;
        }
    }
    return false;
}

void arm(Call call, int err, uint64_t after) noexcept {
    Trigger& t = g_triggers[static_cast<int>(call)];
    t.left.store(static_cast<int64_t>(after), std::memory_order_relaxed);
    t.err.store(err, std::memory_order_release);
}

void disarm() noexcept {
    for (Trigger& t : g_triggers) t.err.store(0, std::memory_order_release);
}

int next_failure(Call call) noexcept {
    Trigger& t = g_triggers[static_cast<int>(call)];
    if (t.err.load(std::memory_order_relaxed) == 0) return 0;
    if (t.left.fetch_sub(1, std::memory_order_acq_rel) != 0) return 0;
    // Exactly one caller sees the count reach zero; it takes the error and disarms.
    return t.err.exchange(0, std::memory_order_acq_rel);
}

}  // namespace pyckpt::fault_injection

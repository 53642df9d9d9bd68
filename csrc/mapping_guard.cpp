#include "mapping_guard.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace pyckpt::mapping_guard {

namespace {

// Enough for one mapping per shard of a checkpoint saved by thousands of ranks; the table lives
// in zero-filled BSS, so untouched slots cost no memory.
constexpr int kSlots = 1 << 16;

struct Slot {
    std::atomic<uintptr_t> begin{0};  // 0: free
    std::atomic<uintptr_t> end{0};
    std::atomic<bool> tripped{false};
};

Slot g_slots[kSlots];
std::atomic<int> g_high{0};  // slots at or above this were never used: the handler stops here

struct sigaction g_previous {};
std::mutex g_install_mu;

std::atomic<bool> g_passed{false};

// Hands a SIGBUS that is not ours to whatever handled it before us, by making that the
// disposition again: a real fault repeats when we return and reaches it directly; a signal sent
// by kill()/raise() does not repeat, so it is sent again. A second SIGBUS that comes back here
// (a previous handler that re-raises, such as Python's faulthandler whose own predecessor may be
// us) gets the default action, so the chain always ends in the process dying as it would have.
void pass_on(int sig, const siginfo_t* info) {
    if (g_passed.exchange(true)) {
        struct sigaction dfl {};
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        ::sigaction(sig, &dfl, nullptr);
        ::raise(sig);
        return;
    }
    ::sigaction(sig, &g_previous, nullptr);
    if (!info || info->si_code <= 0) ::raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void*) {
    // Only a real access past the end of a mapped file (BUS_ADRERR) is ours to absorb; a
    // SIGBUS sent by kill() or a hardware error passes on.
    if (info && info->si_code == BUS_ADRERR) {
        const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
        const int high = g_high.load(std::memory_order_acquire);
        for (int i = 0; i < high; ++i) {
            Slot& s = g_slots[i];
            const uintptr_t b = s.begin.load(std::memory_order_acquire);
            if (b == 0 || addr < b) continue;
            const uintptr_t e = s.end.load(std::memory_order_acquire);
            if (addr >= e) continue;
            const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
            const uintptr_t lo = addr / page * page;
            // The whole tail at once: every page past the new end would fault in turn. Writable,
            // so that a write into a mapped output (output_maps) completes as a read does.
            void* p = ::mmap(reinterpret_cast<void*>(lo), e - lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                             -1, 0);
            if (p == MAP_FAILED) break;
            s.tripped.store(true, std::memory_order_release);
            return;
        }
    }
    pass_on(sig, info);
}

// (Re)installs the handler when someone (e.g. Python's faulthandler, enabled after our import)
// put theirs in front: theirs is kept as the one faults outside our ranges go to.
void ensure_installed() noexcept {
    std::lock_guard<std::mutex> lk(g_install_mu);
    if (g_passed.load()) return;  // a foreign SIGBUS is being handled: the process is going down
    struct sigaction cur {};
    if (::sigaction(SIGBUS, nullptr, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == &on_sigbus) return;
    struct sigaction ours {};
    ours.sa_sigaction = &on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    g_previous = cur;
    ::sigaction(SIGBUS, &ours, nullptr);
}

}  // namespace

int enroll(const void* base, std::size_t len) noexcept {
    if (!base || len == 0) return -1;
    ensure_installed();
    const uintptr_t b = reinterpret_cast<uintptr_t>(base);
    for (int i = 0; i < kSlots; ++i) {
        uintptr_t expected = 0;
        // Claim with a sentinel, publish `end` and then the real `begin`, so the handler never
        // sees a begin without its end.
        if (!g_slots[i].begin.compare_exchange_strong(expected, UINTPTR_MAX, std::memory_order_acq_rel)) continue;
        g_slots[i].tripped.store(false, std::memory_order_relaxed);
        g_slots[i].end.store(b + len, std::memory_order_release);
        g_slots[i].begin.store(b, std::memory_order_release);
        int high = g_high.load(std::memory_order_relaxed);
        while (high < i + 1 && !g_high.compare_exchange_weak(high, i + 1, std::memory_order_acq_rel)) {
        }
        return i;
    }
    return -1;
}

void withdraw(int slot) noexcept {
    if (slot < 0) return;
    g_slots[slot].begin.store(0, std::memory_order_release);
}

bool tripped(int slot) noexcept {
    return slot >= 0 && g_slots[slot].tripped.load(std::memory_order_acquire);
}

}  // namespace pyckpt::mapping_guard

// Test-only failure injection for the executor's output syscalls, so tests can prove that an
// I/O error at any point (ENOSPC on a write, EIO on fsync, ...) removes every partial output
// and surfaces as an error naming the file.
//
// Thread/GIL contract: arm()/disarm() from any thread; next_failure() is called by workers
// right before the real syscall and costs one relaxed atomic load when nothing is armed.
// No Python involvement.
#pragma once

#include <cstdint>
#include <string_view>

namespace pyckpt::fault_injection {

enum class Call { Open = 0, Write, Fsync, Close, Count };

// Parses "open" / "write" / "fsync" / "close"; false if unknown.
bool parse_call(std::string_view name, Call& out) noexcept;
// The (after+1)-th next call of kind `call` fails with `err` (once).
void arm(Call call, int err, uint64_t after) noexcept;
void disarm() noexcept;
// 0, or the errno the caller must fail this call with.
int next_failure(Call call) noexcept;

}  // namespace pyckpt::fault_injection

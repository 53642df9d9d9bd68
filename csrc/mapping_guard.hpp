// Survives files that shrink while they are memory-mapped (inputs read, outputs written in place).
//
// Touching a mapped page past a file's end raises SIGBUS, which would kill the process (and,
// for a loader inside a training job, the job). Every MappedFile registers its range here; a
// process-wide SIGBUS handler that finds the faulting address in a registered range maps
// zero-filled anonymous pages over the rest of that range, marks it tripped and returns, so the
// read completes (with zeros) and the owner, checking tripped() after its reads, reports the
// file as changed instead of using the bytes. Faults outside registered ranges go to the
// handler that was installed before ours.
//
// Thread/GIL contract: enroll()/withdraw()/tripped() are thread-safe and lock-free on the
// reading side; the handler itself only reads the registry and calls mmap. No Python
// involvement.
#pragma once

#include <cstddef>

namespace pyckpt::mapping_guard {

// Registers [base, base+len); returns a slot for withdraw()/tripped(), or -1 when the registry
// is full (the range is then unguarded: a shrink faults as before). Installs the handler if
// another one replaced it since the last call.
int enroll(const void* base, std::size_t len) noexcept;
// Must be called before the range is unmapped.
void withdraw(int slot) noexcept;
// Whether a fault in the slot's range was absorbed (the bytes read there are zeros, not the file's).
bool tripped(int slot) noexcept;

}  // namespace pyckpt::mapping_guard

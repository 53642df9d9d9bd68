// Atomic renames that plain rename(2) cannot express, for publishing an output folder; the
// filesystem type of an open file, which Python's os module does not expose (fstatfs f_type); and
// a positioned write of a whole buffer.
//
// Thread/GIL contract: plain syscalls, safe from any thread; nothing here touches Python.
#pragma once

#include <cstdint>
#include <string>

namespace pyckpt {

// Swaps the two names atomically (renameat2 RENAME_EXCHANGE): a reader sees either the old or
// the new entry at each name, never none. Throws std::system_error naming both paths; EINVAL
// or ENOSYS mean the filesystem or kernel lacks the flag, and the caller decides the fallback.
void rename_exchange(const std::string& a, const std::string& b);

// Renames `from` to `to` only if `to` does not exist (renameat2 RENAME_NOREPLACE). Unlike
// rename(2), never replaces an existing (even empty) folder. EEXIST if `to` exists; EINVAL or
// ENOSYS as above.
void rename_noreplace(const std::string& from, const std::string& to);

// The f_type of the filesystem holding the open file `fd` (fstatfs), so that a caller can refuse
// files of kernel pseudo-filesystems (procfs, sysfs, ...) that pass as regular files. Throws
// std::system_error on failure.
long filesystem_type(int fd);

// Writes the `len` bytes at `p` to `fd` at `off`: short writes continued, EINTR retried, at most
// 1 GiB per call. An armed write fault (fault_injection Call::Write) fails it first. Throws
// std::system_error naming `path`.
void pwrite_all(int fd, const uint8_t* p, uint64_t len, uint64_t off, const std::string& path);

}  // namespace pyckpt

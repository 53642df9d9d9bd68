// Atomic renames that plain rename(2) cannot express, for publishing an output folder.
//
// Thread/GIL contract: plain syscalls, safe from any thread; nothing here touches Python.
#pragma once

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

}  // namespace pyckpt

// Writable shared mappings of output files that are written over in place, kept from one call
// to the next.
//
// A memory save writes the same files again and again (a retired checkpoint's files become the
// next save's, same inodes). Copying into a mapping that stays from one save to the next is a
// plain memcpy into pages already the file's: on tmpfs it measured 2.4x faster than pwrite of
// the same bytes, and 1.6x faster than mapping the file anew each time (the page-table setup).
//
// A cached mapping holds its own descriptor, so its inode cannot be freed and its number reused
// by another file while the entry lives: an entry is found by (device, inode) and is that file.
// Entries of files that no longer have a name, and those not used for several calls, are dropped
// at the start of the next call (begin_call), so a removed checkpoint's memory is not held for
// longer than until the next save, and release_all() drops every one at once.
//
// Thread/GIL contract: every function is thread-safe (one mutex; acquire runs once per output and
// call, not per window). Nothing here touches Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyckpt::output_maps {

// Files smaller than this are written with pwrite: the mapping costs more than it saves.
constexpr uint64_t kMinBytes = 1u << 20;
// The size from which a file written over in place is mapped: kMinBytes, or $PYCKPT_MAP_MIN_BYTES
// (read once; at least 1), which lets the tests take small checkpoints through the mapped path.
uint64_t min_bytes();

// Starts a call: drops the entries whose file lost its last name or that went unused for the
// last few calls.
void begin_call();
// The writable mapping of the open regular file `fd` of `size` bytes (mapped now if it is not
// cached yet, or was cached at another size), held for the caller until done(); null when the
// cache is full of held mappings or the process is out of descriptors (the caller writes
// through its own descriptor; the cache holds at most a quarter of RLIMIT_NOFILE). Throws
// std::system_error naming `path` if the file cannot be mapped.
uint8_t* acquire(int fd, uint64_t size, const std::string& path);
// Gives back a mapping acquire() returned. Returns false if its file shrank under it while held
// (the bytes written past the new end went nowhere); the entry is then dropped.
bool done(const uint8_t* base);
// Creates the file `name` (one component: no '/', not "." or "..") in the open folder `dir_fd`,
// never over an existing entry nor through a link, with `size` bytes allocated now (written as
// zeros: every page the file's, none left for the writer's first access to fault in), and, with
// `map` and from min_bytes() up, its mapping cached as acquire() caches one (a process keeps the
// mappings of only the files it will write itself). A later
// call that writes this file over in place then copies into pages already allocated and mapped:
// the allocation is paid here, off the caller's critical path. `path` names the file in errors.
// Throws std::system_error (ENOSPC when the folder's filesystem is full; the file is then left
// for the caller's clean-up of the folder) or std::invalid_argument for a bad name.
void prepare(int dir_fd, const std::string& name, uint64_t size, const std::string& path, bool map);
// Maps the existing file `name` (one component) of the open folder `dir_fd`, opened without
// following a link, and caches the mapping as acquire() does: the file a later call will write
// over in place (a share the next save retires as its free slot) then needs no page-table set-up in
// that call. Maps nothing and returns false where the entry is not a regular file of exactly `size`
// bytes, or is smaller than min_bytes(), or the cache has no room; true when a mapping is cached.
// Throws std::invalid_argument for a bad name, std::system_error naming `path` if the open or the
// mapping fails for another reason than the entry's absence.
bool map_existing(int dir_fd, const std::string& name, uint64_t size, const std::string& path);
// Unmaps every cached mapping no call holds.
void release_all();
// How many mappings are cached and their bytes (for tests and diagnostics).
std::size_t count();
uint64_t mapped_bytes();

}  // namespace pyckpt::output_maps

// The set of input files an op table reads from: stat'ed during validation, memory-mapped on
// first use, and shared by every worker.
//
// Thread/GIL contract: size_of()/identity()/require() are for the single validating thread;
// map() may then be called concurrently from any number of workers (each file is mapped
// exactly once, guarded by a per-file once_flag). No Python involvement.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fd.hpp"
#include "mapped_file.hpp"

namespace pyckpt {

class SourceSet {
public:
    explicit SourceSet(std::vector<std::string> paths);
    ~SourceSet();

    std::size_t count() const noexcept { return entries_.size(); }
    const std::string& path(std::size_t i) const { return entries_[i]->path; }

    // File size via stat(); throws std::system_error naming the path.
    uint64_t size_of(std::size_t i);
    // (device, inode) of a source that has been stat'ed, for "output would clobber input" checks.
    bool identity(std::size_t i, dev_t& dev, ino_t& ino) const;
    // Records that ops read source i up to byte `end`, re-checked when the file is mapped so a
    // file that shrank after validation fails cleanly instead of faulting.
    void require(std::size_t i, uint64_t end);

    // Makes source i memory the caller owns (`size` bytes at `data`) instead of the file at its
    // path, which then only names it in messages. Before any other use of source i.
    void borrow(std::size_t i, const uint8_t* data, uint64_t size);
    bool is_memory(std::size_t i) const { return entries_[i]->memory; }

    // Thread-safe lazy mapping. Throws std::system_error, or SourceChangedError if the file
    // became shorter than the validated ranges.
    const MappedFile& map(std::size_t i);

    // A new read-only descriptor of source i, checked to be the file that was stat'ed and
    // validated (same device and inode, not shorter than the validated ranges): for in-kernel
    // copies, which read by descriptor rather than through the mapping. Throws
    // SourceChangedError if the path now names another or shorter file.
    UniqueFd open_verified(std::size_t i);

    // Whether source i is a file in memory (tmpfs, ramfs): there a plain run is copied by pread
    // (read_exact on an open_verified descriptor) rather than from a mapping, no fault per source
    // page and no unmapping after, 1.7x the mapped copy. A file on a disk keeps the mapping, whose
    // MADV_WILLNEED streams an evicted run at 2-3x a pread without read-ahead and whose pages stop
    // at the run (a pread with read-ahead brings in the next rank's pages). A choice of speed only:
    // the descriptor is still checked to be the validated file.
    bool held_in_memory(std::size_t i);

    // Throws SourceChangedError naming the first mapped source that shrank while mapped (its
    // reads past the new end returned zeros). Call after the workers are done.
    void check_unchanged() const;

private:
    struct Entry {
        std::string path;
        bool stat_done = false;
        bool memory = false;
        const uint8_t* memory_data = nullptr;
        uint64_t size = 0;
        dev_t dev = 0;
        ino_t ino = 0;
        uint64_t required = 0;
        std::once_flag once;
        std::unique_ptr<MappedFile> file;
        std::once_flag fs_once;
        bool memory_fs = false;
    };
    std::vector<std::unique_ptr<Entry>> entries_;
};

// Reads [offset, offset+len) of the open file `fd` into `out` (pread, EINTR retried). Throws
// std::system_error naming `path`, or SourceChangedError where the file ends early.
void read_exact(int fd, uint64_t offset, uint8_t* out, uint64_t len, const std::string& path);

}  // namespace pyckpt

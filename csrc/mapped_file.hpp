// Read-only memory mapping of a whole file.
//
// Thread/GIL contract: construction and destruction belong to one thread; once constructed the
// object is immutable, and data()/size()/drop() may be called concurrently from any number of
// threads. No Python involvement. The mapping is MAP_SHARED + PROT_READ, so dropping pages
// never loses data: a later access faults them back in from the page cache. Reads past an end
// the file shrank to after mapping do not fault (see mapping_guard.hpp): they read zeros and
// set changed().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fd.hpp"

namespace pyckpt {

// A read-only descriptor of `path`, refusing anything but a regular file (a folder, a FIFO, a
// device named like a checkpoint file), with the file's size. O_NONBLOCK: opening a FIFO must not
// wait for a writer; it has no effect on regular files. Throws std::system_error naming the path.
UniqueFd open_regular_file(const std::string& path, uint64_t& size);

class MappedFile {
public:
    // Throws std::system_error (errno + path) if the file cannot be opened, stat'ed or mapped.
    // `random_access`: MADV_RANDOM for the whole mapping (header parsing touches a few pages of
    // large files; the default read-around would pull in a whole readahead window per fault).
    explicit MappedFile(std::string path, bool random_access = false);
    // A view of memory the caller owns and keeps alive (a memory source): nothing is mapped,
    // dropped or unmapped, and `label` names it in messages.
    MappedFile(std::string label, const uint8_t* data, uint64_t size);
    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const std::string& path() const noexcept { return path_; }
    const uint8_t* data() const noexcept { return data_; }
    uint64_t size() const noexcept { return size_; }

    // Unmaps [offset, offset+len) rounded outward to pages from this process's page tables
    // (MADV_DONTNEED), so streaming through a large file does not grow our RSS; the kernel
    // keeps the pages cached. Best effort: failures are ignored.
    void drop(uint64_t offset, uint64_t len) const noexcept;
    // Asks the kernel to read [offset, offset+len) ahead (MADV_WILLNEED), so the faults that follow
    // find their pages in flight or cached and trigger no read-around of their own.
    void prefetch(uint64_t offset, uint64_t len) const noexcept;

    // True once a read ran past the file's current end (it shrank after mapping): the bytes read
    // from there on were zeros, not the file's. Owners check this after reading and discard.
    bool changed() const noexcept;

    // Releases the mapping early; data() becomes null. Not safe concurrently with readers.
    void close() noexcept;

private:
    std::string path_;
    const uint8_t* data_ = nullptr;
    uint64_t size_ = 0;
    int guard_slot_ = -1;
    bool borrowed_ = false;
};

}  // namespace pyckpt

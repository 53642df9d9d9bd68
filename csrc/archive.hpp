// Read-only view of a torch.save archive: a memory-mapped ZIP whose members are all stored
// (uncompressed), indexed from the central directory and cross-checked against local headers.
//
// Thread/GIL contract: the constructor parses (headers only, no member data is read) and throws
// ArchiveError/system_error; after that every const method is safe to call concurrently from
// any thread. close() must not race with other calls. Nothing here touches Python; callers
// may release the GIL around any call.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "mapped_file.hpp"

namespace pyckpt {

struct ArchiveMember {
    std::string name;
    uint64_t header_offset = 0;
    uint64_t data_offset = 0;  // absolute offset of the first data byte in the file
    uint64_t size = 0;
    uint32_t crc32 = 0;  // as recorded in the central directory (not verified)
};

class Archive {
public:
    explicit Archive(std::string path);
    // As above, except that a file of at most `read_limit` bytes is read into memory (pread) rather
    // than mapped. A planning pass opens thousands of small archives on several threads: mapping
    // and unmapping each takes the process's address-space lock and unmapping interrupts the other
    // CPUs to flush their TLBs, so those threads mostly waited on each other; reading costs one
    // copy of a few KB. A read-in archive never changes under its reader (check_unchanged passes).
    Archive(std::string path, uint64_t read_limit);
    // The archive that bytes [base, base + length) of the file hold, as torch.distributed.checkpoint
    // writes one torch.save archive per tensor chunk back to back in a data file: the ZIP is parsed
    // within that window alone (its own offsets count from `base`, as torch's writer counted them),
    // and members() report absolute file offsets. A window past the end of the file is refused.
    Archive(std::string path, uint64_t base, uint64_t length, uint64_t read_limit);

    const std::string& path() const noexcept { return path_; }
    uint64_t size() const noexcept { return size_; }  // the window's length for a windowed archive
    uint64_t base() const noexcept { return base_; }
    const std::vector<ArchiveMember>& members() const noexcept { return members_; }

    // Throws MemberNotFound naming the file and the member.
    const ArchiveMember& member(std::string_view name) const;
    // Pointer to the member's bytes inside the mapping; valid until close(). Throws
    // std::logic_error once closed.
    const uint8_t* member_data(const ArchiveMember& m) const;

    // The single top-level folder every member lives in; ArchiveError if there is none.
    std::string prefix() const;

    // Throws SourceChangedError if the file shrank under the mapping since it was opened, so that
    // bytes read from member_data() were partly zeros. Call after reading.
    void check_unchanged() const;

    void close() noexcept;
    bool closed() const noexcept { return data_ == nullptr; }

private:
    void open_mapped();
    void read_in(int fd, uint64_t offset, uint64_t size);
    void parse();
    bool read_zip64_extra(const uint8_t* x, uint64_t len, std::initializer_list<uint64_t*> slots,
                          std::string_view member, const char* where) const;
    [[noreturn]] void fail(std::string_view what) const;
    [[noreturn]] void fail(std::string_view member, std::string_view what) const;

    std::string path_;
    std::unique_ptr<MappedFile> map_;
    std::string held_;                // the file's bytes when read in rather than mapped
    const uint8_t* data_ = nullptr;   // map_'s bytes or held_'s; null once closed
    uint64_t size_ = 0;
    uint64_t base_ = 0;               // where the archive starts in the file (0 unless windowed)
    std::vector<ArchiveMember> members_;
    std::unordered_map<std::string_view, std::size_t> index_;  // views into members_[i].name
};

}  // namespace pyckpt

#include "sources.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include "errors.hpp"

namespace pyckpt {

SourceSet::SourceSet(std::vector<std::string> paths) {
    entries_.reserve(paths.size());
    for (auto& p : paths) {
        auto e = std::make_unique<Entry>();
        e->path = std::move(p);
        entries_.push_back(std::move(e));
    }
}

SourceSet::~SourceSet() = default;

uint64_t SourceSet::size_of(std::size_t i) {
    Entry& e = *entries_[i];
    if (!e.stat_done) {
        struct stat st {};
        if (::stat(e.path.c_str(), &st) != 0) throw_errno("stat", e.path);
        if (!S_ISREG(st.st_mode)) throw_errno_code(EINVAL, "read (not a regular file)", e.path);
        e.size = static_cast<uint64_t>(st.st_size);
        e.dev = st.st_dev;
        e.ino = st.st_ino;
        e.stat_done = true;
    }
    return e.size;
}

bool SourceSet::identity(std::size_t i, dev_t& dev, ino_t& ino) const {
    const Entry& e = *entries_[i];
    if (!e.stat_done || e.memory) return false;
    dev = e.dev;
    ino = e.ino;
    return true;
}

void SourceSet::require(std::size_t i, uint64_t end) {
    if (end > entries_[i]->required) entries_[i]->required = end;
}

void SourceSet::borrow(std::size_t i, const uint8_t* data, uint64_t size) {
    Entry& e = *entries_[i];
    e.memory = true;
    e.memory_data = data;
    e.size = size;
    e.stat_done = true;  // size known; dev/ino stay 0, so identity() never matches an output
}

const MappedFile& SourceSet::map(std::size_t i) {
    Entry& e = *entries_[i];
    if (e.memory) {
        std::call_once(e.once, [&] {
            if (e.size < e.required)
                throw SourceChangedError("memory source '" + escape_bytes(e.path) + "' holds " + std::to_string(e.size) +
                                         " bytes but ops read up to byte " + std::to_string(e.required));
            e.file = std::make_unique<MappedFile>(e.path, e.memory_data, e.size);
        });
        return *e.file;
    }
    std::call_once(e.once, [&] {
        auto f = std::make_unique<MappedFile>(e.path);
        if (f->size() < e.required)
            throw SourceChangedError("source '" + escape_bytes(e.path) + "' shrank to " + std::to_string(f->size()) +
                                     " bytes after validation (ops read up to byte " +
                                     std::to_string(e.required) + ")");
        e.file = std::move(f);
    });
    return *e.file;
}

UniqueFd SourceSet::open_verified(std::size_t i) {
    Entry& e = *entries_[i];
    if (e.memory) throw_errno_code(EINVAL, "open (a memory source has no file)", e.path);
    UniqueFd fd(::open(e.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) throw_errno("open", e.path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw_errno("stat", e.path);
    if (!e.stat_done || st.st_dev != e.dev || st.st_ino != e.ino)
        throw SourceChangedError("source '" + escape_bytes(e.path) +
                                 "' was replaced by another file after it was validated (another process?)");
    if (static_cast<uint64_t>(st.st_size) < e.required) throw source_changed_error(e.path);
    return fd;
}

bool SourceSet::held_in_memory(std::size_t i) {
    Entry& e = *entries_[i];
    if (e.memory) return false;
    std::call_once(e.fs_once, [&] {
        struct statfs fs {};
        e.memory_fs = ::statfs(e.path.c_str(), &fs) == 0 &&
                      (fs.f_type == static_cast<decltype(fs.f_type)>(TMPFS_MAGIC) ||
                       fs.f_type == static_cast<decltype(fs.f_type)>(RAMFS_MAGIC));
    });
    return e.memory_fs;
}

void read_exact(int fd, uint64_t offset, uint8_t* out, uint64_t len, const std::string& path) {
    while (len > 0) {
        const ssize_t n = ::pread(fd, out, len, static_cast<off_t>(offset));
        if (n < 0) {
            if (errno == EINTR) continue;
            throw_errno("read", path);
        }
        if (n == 0) throw source_changed_error(path);
        out += n;
        offset += static_cast<uint64_t>(n);
        len -= static_cast<uint64_t>(n);
    }
}

void SourceSet::check_unchanged() const {
    for (const auto& e : entries_) {
        if (e->file && e->file->changed()) throw source_changed_error(e->path);
    }
}

}  // namespace pyckpt

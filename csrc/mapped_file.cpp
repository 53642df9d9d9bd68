#include "mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "errors.hpp"
#include "fd.hpp"
#include "mapping_guard.hpp"

namespace pyckpt {

namespace {
uint64_t page_size() {
    static const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    return ps;
}
}  // namespace

UniqueFd open_regular_file(const std::string& path, uint64_t& size) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    if (!fd) throw_errno("open", path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw_errno("stat", path);
    if (!S_ISREG(st.st_mode)) throw_errno_code(EINVAL, "read (not a regular file)", path);
    size = static_cast<uint64_t>(st.st_size);
    return fd;
}

MappedFile::MappedFile(std::string path, bool random_access) : path_(std::move(path)) {
    UniqueFd fd = open_regular_file(path_, size_);
    if (size_ > 0) {
        void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd.get(), 0);
        if (p == MAP_FAILED) throw_errno("mmap", path_);
        data_ = static_cast<const uint8_t*>(p);
        if (random_access) ::madvise(p, size_, MADV_RANDOM);
        guard_slot_ = mapping_guard::enroll(p, size_);
    }
    // The mapping keeps the file referenced; holding the descriptor would only cost fd slots
    // when thousands of shards are open.
    fd.reset();
}

MappedFile::MappedFile(std::string label, const uint8_t* data, uint64_t size)
    : path_(std::move(label)), data_(data), size_(size), borrowed_(true) {}

MappedFile::~MappedFile() { close(); }

void MappedFile::close() noexcept {
    if (data_ && !borrowed_) {
        mapping_guard::withdraw(guard_slot_);
        ::munmap(const_cast<uint8_t*>(data_), size_);
    }
    data_ = nullptr;
    guard_slot_ = -1;
}

bool MappedFile::changed() const noexcept { return mapping_guard::tripped(guard_slot_); }

void MappedFile::prefetch(uint64_t offset, uint64_t len) const noexcept {
    if (!data_ || borrowed_ || len == 0 || offset >= size_) return;
    uint64_t end = offset + len < size_ ? offset + len : size_;
    const uint64_t ps = page_size();
    uint64_t lo = offset / ps * ps;
    ::madvise(const_cast<uint8_t*>(data_) + lo, end - lo, MADV_WILLNEED);
}

// A fault maps the whole large folio around it (fault-around), so reading a range also maps up to
// a folio of its neighbours; when a neighbour was consumed earlier (windows do not visit a source
// in order) those pages stayed mapped for the rest of the run: 12 % of the input at tp 4. Dropping
// a folio's worth of slack on both sides catches them; a page still in use elsewhere just
// re-faults from the page cache.
static constexpr uint64_t kDropSlack = uint64_t{2} << 20;

void MappedFile::drop(uint64_t offset, uint64_t len) const noexcept {
    // MADV_DONTNEED on anonymous memory would zero the caller's bytes
    if (!data_ || borrowed_ || len == 0 || offset >= size_) return;
    uint64_t end = offset + len < size_ ? offset + len : size_;
    const uint64_t ps = page_size();
    uint64_t lo = (offset > kDropSlack ? offset - kDropSlack : 0) / ps * ps;
    end = end + kDropSlack < size_ ? end + kDropSlack : size_;
    uint64_t hi = (end + ps - 1) / ps * ps;
    ::madvise(const_cast<uint8_t*>(data_) + lo, hi - lo, MADV_DONTNEED);
}

}  // namespace pyckpt

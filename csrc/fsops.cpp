#include "fsops.hpp"

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "errors.hpp"
#include "fault_injection.hpp"

namespace pyckpt {

namespace {

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

// The raw syscall, so that builds against a C library without the renameat2 wrapper still work.
void renameat2_or_throw(const std::string& from, const std::string& to, unsigned flags, const char* what) {
#ifdef SYS_renameat2
    if (::syscall(SYS_renameat2, AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags) == 0) return;
    int e = errno;
#else
    int e = ENOSYS;
#endif
    throw std::system_error(e, std::generic_category(), std::string(what) + " '" + from + "' -> '" + to + "'");
}

}  // namespace

void rename_exchange(const std::string& a, const std::string& b) {
    renameat2_or_throw(a, b, RENAME_EXCHANGE, "exchange");
}

void rename_noreplace(const std::string& from, const std::string& to) {
    renameat2_or_throw(from, to, RENAME_NOREPLACE, "rename");
}

long filesystem_type(int fd) {
    struct statfs st {};
    if (::fstatfs(fd, &st) != 0) throw std::system_error(errno, std::generic_category(), "fstatfs");
    return static_cast<long>(st.f_type);
}

void pwrite_all(int fd, const uint8_t* p, uint64_t len, uint64_t off, const std::string& path) {
    if (int e = fault_injection::next_failure(fault_injection::Call::Write)) throw_errno_code(e, "write", path);
    while (len > 0) {
        // Linux caps one write at ~2 GiB; stay well below it.
        std::size_t chunk = static_cast<std::size_t>(std::min<uint64_t>(len, 1u << 30));
        ssize_t n = ::pwrite(fd, p, chunk, static_cast<off_t>(off));
        if (n < 0) {
            if (errno == EINTR) continue;
            throw_errno("write", path);
        }
        if (n == 0) throw_errno_code(EIO, "write (no progress)", path);
        p += n;
        off += static_cast<uint64_t>(n);
        len -= static_cast<uint64_t>(n);
    }
}

}  // namespace pyckpt

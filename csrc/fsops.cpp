#include "fsops.hpp"

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

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

}  // namespace pyckpt

// An owned POSIX file descriptor, so that no error path can leak one or close one twice.
//
// Thread/GIL contract: a plain value type; one owner at a time (move-only). Nothing here
// touches Python.
#pragma once

#include <unistd.h>

#include <cerrno>

namespace pyckpt {

class UniqueFd {
public:
    UniqueFd() noexcept = default;
    explicit UniqueFd(int fd) noexcept : fd_(fd) {}
    ~UniqueFd() { reset(); }

    UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
    UniqueFd& operator=(UniqueFd&& other) noexcept {
        if (this != &other) reset(other.release());
        return *this;
    }
    UniqueFd(const UniqueFd&) = delete;
    UniqueFd& operator=(const UniqueFd&) = delete;

    int get() const noexcept { return fd_; }
    explicit operator bool() const noexcept { return fd_ >= 0; }

    // Gives up ownership without closing.
    int release() noexcept {
        int fd = fd_;
        fd_ = -1;
        return fd;
    }

    // Closes the held descriptor (if any) ignoring failures and takes `fd`. For paths that are
    // already failing or only read: errno is preserved, so a caller may still report the error
    // that led here after the descriptor is gone.
    void reset(int fd = -1) noexcept {
        if (fd_ >= 0) {
            int saved = errno;
            ::close(fd_);
            errno = saved;
        }
        fd_ = fd;
    }

    // Closes now and reports the outcome: 0, or the errno of a failed close (a write-back error
    // may only surface here). The descriptor is released either way: on Linux it is gone even
    // when close fails, and EINTR counts as success because retrying could close a descriptor
    // another thread has just been given.
    int close() noexcept {
        if (fd_ < 0) return 0;
        int rc = ::close(fd_);
        fd_ = -1;
        if (rc != 0 && errno != EINTR) return errno;
        return 0;
    }

private:
    int fd_ = -1;
};

}  // namespace pyckpt

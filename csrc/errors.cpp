#include "errors.hpp"

#include <cerrno>

namespace pyckpt {

ArchiveError archive_error(std::string_view path, std::string_view what) {
    std::string msg;
    msg.reserve(path.size() + what.size() + 2);
    msg.append(path).append(": ").append(what);
    return ArchiveError(msg);
}

ArchiveError archive_error(std::string_view path, std::string_view member, std::string_view what) {
    std::string msg;
    msg.append(path).append(": member '").append(member).append("': ").append(what);
    return ArchiveError(msg);
}

void throw_errno_code(int code, std::string_view op, std::string_view path) {
    std::string ctx;
    ctx.append(op).append(" '").append(path).append("'");
    throw std::system_error(code, std::generic_category(), ctx);
}

void throw_errno(std::string_view op, std::string_view path) { throw_errno_code(errno, op, path); }

}  // namespace pyckpt

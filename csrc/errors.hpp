// Exception types shared by the native core, plus helpers that attach a path to errno failures.
//
// Thread/GIL contract: plain C++ types with no shared state; safe from any thread. Nothing here
// touches Python; the binding layer maps each type to a Python exception class.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

namespace pyckpt {

// Input that is not a well-formed, uncompressed ZIP/torch.save archive. Derives from
// runtime_error (not invalid_argument) so that generic translators cannot swallow it before the
// binding maps it to pyckpt._core.ArchiveError.
class ArchiveError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Lookup of a member name that the archive does not contain (surfaced as KeyError).
class MemberNotFound : public std::out_of_range {
public:
    using std::out_of_range::out_of_range;
};

// Raised by an executor after its progress callback asked it to stop; the caller already holds
// the reason (e.g. a pending Python exception), so this carries no message of its own.
class Cancelled : public std::exception {
public:
    const char* what() const noexcept override { return "operation cancelled"; }
};

// Builds "<path>: <what>" (and "<path>: member '<member>': <what>") so every archive error
// names the file and, where one is involved, the member.
ArchiveError archive_error(std::string_view path, std::string_view what);
ArchiveError archive_error(std::string_view path, std::string_view member, std::string_view what);

// Throws std::system_error for the current errno with "<op> '<path>'" as context, so that the
// Python OSError both carries the errno and names the file.
[[noreturn]] void throw_errno(std::string_view op, std::string_view path);
[[noreturn]] void throw_errno_code(int code, std::string_view op, std::string_view path);

}  // namespace pyckpt

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

// The executor refused an op table or output list (bad index, range, overlap, gap, path outside
// the root): the plan broke a rule its producer should have enforced. Nothing was written.
class PlanError : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

// A memory-mapped input lost bytes while it was being read (another process truncated or
// replaced it): the bytes read are not the file's, so the result must be discarded.
class SourceChangedError : public std::runtime_error {
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

// Printable form of untrusted bytes (member names, paths from input) for one-line messages:
// non-UTF-8 bytes and control characters become \xNN escapes (a backslash too, so the form is unambiguous).
std::string escape_bytes(std::string_view raw);
// Whether `raw` is well-formed UTF-8 without control characters (C0, DEL, C1).
bool is_clean_utf8(std::string_view raw);

// Builds "<path>: <what>" (and "<path>: member '<member>': <what>") so every archive error
// names the file and, where one is involved, the member.
ArchiveError archive_error(std::string_view path, std::string_view what);
ArchiveError archive_error(std::string_view path, std::string_view member, std::string_view what);

// "source '<path>' became shorter while it was being read ...", for both ways a shrink shows.
SourceChangedError source_changed_error(std::string_view path);

// Throws std::system_error for the current errno with "<op> '<path>'" as context, so that the
// Python OSError both carries the errno and names the file.
[[noreturn]] void throw_errno(std::string_view op, std::string_view path);
[[noreturn]] void throw_errno_code(int code, std::string_view op, std::string_view path);

}  // namespace pyckpt

#include "errors.hpp"

#include <cerrno>
#include <cstdint>

namespace pyckpt {

ArchiveError archive_error(std::string_view path, std::string_view what) {
    std::string msg;
    msg.reserve(path.size() + what.size() + 2);
    msg.append(escape_bytes(path)).append(": ").append(what);
    return ArchiveError(msg);
}

ArchiveError archive_error(std::string_view path, std::string_view member, std::string_view what) {
    std::string msg;
    msg.append(escape_bytes(path)).append(": member '").append(escape_bytes(member)).append("': ").append(what);
    return ArchiveError(msg);
}

SourceChangedError source_changed_error(std::string_view path) {
    std::string msg = "source '";
    msg.append(escape_bytes(path))
        .append("' became shorter while it was being read (changed by another process?); the bytes read from it "
                "are not its content");
    return SourceChangedError(msg);
}

void throw_errno_code(int code, std::string_view op, std::string_view path) {
    std::string ctx;
    ctx.append(op).append(" '").append(path).append("'");
    throw std::system_error(code, std::generic_category(), ctx);
}

void throw_errno(std::string_view op, std::string_view path) { throw_errno_code(errno, op, path); }

}  // namespace pyckpt

namespace pyckpt {

namespace {

// Length of the UTF-8 sequence starting at s[i] if it is well-formed (shortest form, no
// surrogates, at most U+10FFFF) and not a control character; 0 otherwise.
std::size_t clean_sequence(std::string_view s, std::size_t i) {
    const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned c = b(i);
    if (c < 0x20 || c == 0x7f) return 0;
    if (c < 0x80) return 1;
    std::size_t len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
        cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (s.size() - i < len) return 0;
    for (std::size_t k = 1; k < len; ++k) {
        if ((b(i + k) & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (b(i + k) & 0x3f);
    }
    const uint32_t min_cp = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
    if (cp < min_cp || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    if (cp >= 0x80 && cp <= 0x9f) return 0;  // C1 controls
    return len;
}

}  // namespace

bool is_clean_utf8(std::string_view raw) {
    for (std::size_t i = 0; i < raw.size();) {
        std::size_t n = clean_sequence(raw, i);
        if (n == 0) return false;
        i += n;
    }
    return true;
}

std::string escape_bytes(std::string_view raw) {
    static const char hex[] = "0123456789abcdef";
    std::string out;
    out.reserve(raw.size());
    for (std::size_t i = 0; i < raw.size();) {
        std::size_t n = clean_sequence(raw, i);
        if (n != 0 && raw[i] != '\\') {
            out.append(raw.substr(i, n));
            i += n;
            continue;
        }
        const unsigned c = static_cast<unsigned char>(raw[i]);
        out += '\\';
        out += 'x';
        out += hex[c >> 4];
        out += hex[c & 15];
        ++i;
    }
    return out;
}

}  // namespace pyckpt

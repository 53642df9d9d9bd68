#include "pickle_scan.hpp"

#include <cstring>
#include <iterator>

namespace pyckpt {

namespace {

// How an opcode's argument is laid out (pickletools' argument descriptors).
enum class Arg : uint8_t {
    None,      // no argument
    Fixed,     // `size` bytes
    Len1,      // 1-byte length, then that many bytes
    Len4,      // 4-byte little-endian length, then that many bytes
    Len8,      // 8-byte little-endian length, then that many bytes
    Line,      // up to and including '\n'
    TwoLines,  // two '\n'-terminated lines (GLOBAL, INST)
};

// One pickle opcode: pickletools' name, its argument layout, and whether torch's weights-only
// unpickler (as of torch 2.13) implements it. That unpickler refuses every opcode it does not
// implement, so `torch` is the allowlist for files copied verbatim; the tests check it against
// the installed torch.
struct OpDef {
    uint8_t code;
    const char* name;
    Arg arg;
    uint8_t size;  // of a Fixed argument
    bool torch;
};

constexpr OpDef kOpcodes[] = {
    {'I', "INT", Arg::Line, 0, false},
    {'J', "BININT", Arg::Fixed, 4, true},
    {'K', "BININT1", Arg::Fixed, 1, true},
    {'M', "BININT2", Arg::Fixed, 2, true},
    {'L', "LONG", Arg::Line, 0, false},
    {0x8a, "LONG1", Arg::Len1, 0, true},
    {0x8b, "LONG4", Arg::Len4, 0, false},
    {'S', "STRING", Arg::Line, 0, false},
    {'T', "BINSTRING", Arg::Len4, 0, false},
    {'U', "SHORT_BINSTRING", Arg::Len1, 0, true},
    {'B', "BINBYTES", Arg::Len4, 0, false},
    {'C', "SHORT_BINBYTES", Arg::Len1, 0, false},
    {0x8e, "BINBYTES8", Arg::Len8, 0, false},
    {0x96, "BYTEARRAY8", Arg::Len8, 0, false},
    {0x97, "NEXT_BUFFER", Arg::None, 0, false},
    {0x98, "READONLY_BUFFER", Arg::None, 0, false},
    {'N', "NONE", Arg::None, 0, true},
    {0x88, "NEWTRUE", Arg::None, 0, true},
    {0x89, "NEWFALSE", Arg::None, 0, true},
    {'V', "UNICODE", Arg::Line, 0, false},
    {0x8c, "SHORT_BINUNICODE", Arg::Len1, 0, false},
    {'X', "BINUNICODE", Arg::Len4, 0, true},
    {0x8d, "BINUNICODE8", Arg::Len8, 0, false},
    {'F', "FLOAT", Arg::Line, 0, false},
    {'G', "BINFLOAT", Arg::Fixed, 8, true},
    {']', "EMPTY_LIST", Arg::None, 0, true},
    {'a', "APPEND", Arg::None, 0, true},
    {'e', "APPENDS", Arg::None, 0, true},
    {'l', "LIST", Arg::None, 0, false},
    {')', "EMPTY_TUPLE", Arg::None, 0, true},
    {'t', "TUPLE", Arg::None, 0, true},
    {0x85, "TUPLE1", Arg::None, 0, true},
    {0x86, "TUPLE2", Arg::None, 0, true},
    {0x87, "TUPLE3", Arg::None, 0, true},
    {'}', "EMPTY_DICT", Arg::None, 0, true},
    {'d', "DICT", Arg::None, 0, false},
    {'s', "SETITEM", Arg::None, 0, true},
    {'u', "SETITEMS", Arg::None, 0, true},
    {0x8f, "EMPTY_SET", Arg::None, 0, true},
    {0x90, "ADDITEMS", Arg::None, 0, false},
    {0x91, "FROZENSET", Arg::None, 0, false},
    {'0', "POP", Arg::None, 0, false},
    {'2', "DUP", Arg::None, 0, false},
    {'(', "MARK", Arg::None, 0, true},
    {'1', "POP_MARK", Arg::None, 0, false},
    {'g', "GET", Arg::Line, 0, false},
    {'h', "BINGET", Arg::Fixed, 1, true},
    {'j', "LONG_BINGET", Arg::Fixed, 4, true},
    {'p', "PUT", Arg::Line, 0, false},
    {'q', "BINPUT", Arg::Fixed, 1, true},
    {'r', "LONG_BINPUT", Arg::Fixed, 4, true},
    {0x94, "MEMOIZE", Arg::None, 0, false},
    {0x82, "EXT1", Arg::Fixed, 1, false},
    {0x83, "EXT2", Arg::Fixed, 2, false},
    {0x84, "EXT4", Arg::Fixed, 4, false},
    {'c', "GLOBAL", Arg::TwoLines, 0, true},
    {0x93, "STACK_GLOBAL", Arg::None, 0, false},
    {'R', "REDUCE", Arg::None, 0, true},
    {'b', "BUILD", Arg::None, 0, true},
    {'i', "INST", Arg::TwoLines, 0, false},
    {'o', "OBJ", Arg::None, 0, false},
    {0x81, "NEWOBJ", Arg::None, 0, true},
    {0x92, "NEWOBJ_EX", Arg::None, 0, false},
    {0x80, "PROTO", Arg::Fixed, 1, true},
    {'.', "STOP", Arg::None, 0, true},
    {0x95, "FRAME", Arg::Fixed, 8, false},  // its opcodes follow inline
    {'P', "PERSID", Arg::Line, 0, false},
    {'Q', "BINPERSID", Arg::None, 0, true},
};

// A byte listed twice would silently take the later entry's layout and allowlist flag.
constexpr bool codes_unique() {
    for (std::size_t i = 0; i < std::size(kOpcodes); ++i)
        for (std::size_t j = i + 1; j < std::size(kOpcodes); ++j)
            if (kOpcodes[i].code == kOpcodes[j].code) return false;
    return true;
}
static_assert(codes_unique(), "each opcode byte is defined once");

// kOpcodes indexed by byte; `def` is null for a byte that is no opcode.
struct Table {
    const OpDef* def[256];
    constexpr Table() : def() {
        for (const OpDef& d : kOpcodes) def[d.code] = &d;
    }
};

constexpr Table kTable;

uint64_t le(const uint8_t* p, unsigned n) {
    uint64_t v = 0;
    for (unsigned i = 0; i < n; ++i) v |= uint64_t{p[i]} << (8 * i);
    return v;
}

}  // namespace

PickleScan scan_pickle(const uint8_t* data, std::size_t len) noexcept {
    PickleScan out;
    std::size_t pos = 0;
    auto record = [&](uint64_t index, std::size_t at) {
        ++out.stores;
        const int64_t idx = index > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(index);
        if (idx > out.max_index) {
            out.max_index = idx;
            out.max_index_at = at;
        }
    };
    while (pos < len) {
        const uint8_t code = data[pos];
        const OpDef* const def = kTable.def[code];
        if (out.disallowed_at < 0 && !(def && def->torch)) {
            out.disallowed_at = static_cast<int64_t>(pos);
            out.disallowed_op = code;
        }
        if (!def) {
            out.scanned = pos;
            return out;
        }
        const OpDef& op = *def;
        const std::size_t at = pos;
        const std::size_t left = len - pos - 1;
        const uint8_t* a = data + pos + 1;
        std::size_t arg = 0;
        switch (op.arg) {
            case Arg::None:
                break;
            case Arg::Fixed:
                arg = op.size;
                break;
            case Arg::Len1:
            case Arg::Len4:
            case Arg::Len8: {
                const unsigned w = op.arg == Arg::Len1 ? 1 : op.arg == Arg::Len4 ? 4 : 8;
                if (left < w) {
                    out.scanned = pos;
                    return out;
                }
                const uint64_t n = le(a, w);
                if (n > left - w) {
                    out.scanned = pos;
                    out.overlong = true;
                    return out;
                }
                arg = w + static_cast<std::size_t>(n);
                break;
            }
            case Arg::Line:
            case Arg::TwoLines: {
                const void* nl = std::memchr(a, '\n', left);
                if (!nl) {
                    out.scanned = pos;
                    return out;
                }
                arg = static_cast<std::size_t>(static_cast<const uint8_t*>(nl) - a) + 1;
                if (op.arg == Arg::TwoLines) {
                    const void* nl2 = std::memchr(a + arg, '\n', left - arg);
                    if (!nl2) {
                        out.scanned = pos;
                        return out;
                    }
                    arg = static_cast<std::size_t>(static_cast<const uint8_t*>(nl2) - a) + 1;
                }
                break;
            }
        }
        if (arg > left) {
            out.scanned = pos;
            return out;
        }
        if (code == 0x95 && le(a, 8) > left - arg) {  // FRAME longer than what follows
            out.scanned = pos;
            out.overlong = true;
            return out;
        }
        if (code == 'q') {
            record(a[0], at);
        } else if (code == 'r') {
            record(le(a, 4), at);
        } else if (code == 0x94) {  // MEMOIZE stores at the next free index
            ++out.stores;
        } else if (code == 'p') {   // PUT: decimal text; anything else is left to the unpickler
            uint64_t v = 0;
            bool digits = arg > 1;
            for (std::size_t i = 0; i + 1 < arg && digits; ++i) {
                if (a[i] < '0' || a[i] > '9') digits = false;
                else v = v > (UINT64_MAX - 9) / 10 ? UINT64_MAX : v * 10 + (a[i] - '0');
            }
            if (digits) record(v, at);
        }
        pos += 1 + arg;
        if (code == '.') break;
    }
    out.scanned = pos;
    return out;
}

const char* pickle_opcode_name(uint8_t code) noexcept {
    const OpDef* def = kTable.def[code];
    return def ? def->name : nullptr;
}

bool torch_load_reads(uint8_t code) noexcept {
    const OpDef* def = kTable.def[code];
    return def && def->torch;
}

}  // namespace pyckpt

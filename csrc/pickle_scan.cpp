#include "pickle_scan.hpp"

#include <cstring>

namespace pyckpt {

namespace {

// How an opcode's argument is laid out (pickletools' argument descriptors).
enum class Arg : uint8_t {
    Unknown,   // not a pickle opcode
    None,      // no argument
    Fixed,     // `size` bytes
    Len1,      // 1-byte length, then that many bytes
    Len4,      // 4-byte little-endian length, then that many bytes
    Len8,      // 8-byte little-endian length, then that many bytes
    Line,      // up to and including '\n'
    TwoLines,  // two '\n'-terminated lines (GLOBAL, INST)
};

struct Op {
    Arg arg = Arg::Unknown;
    uint8_t size = 0;
};

struct Table {
    Op ops[256];
    constexpr Table() : ops() {
        for (unsigned char c : "(.012NQRabd}elot)su]\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98")
            if (c) ops[c] = {Arg::None, 0};
        ops[static_cast<unsigned char>('J')] = {Arg::Fixed, 4};     // BININT
        ops[static_cast<unsigned char>('K')] = {Arg::Fixed, 1};     // BININT1
        ops[static_cast<unsigned char>('M')] = {Arg::Fixed, 2};     // BININT2
        ops[static_cast<unsigned char>('G')] = {Arg::Fixed, 8};     // BINFLOAT
        ops[static_cast<unsigned char>('h')] = {Arg::Fixed, 1};     // BINGET
        ops[static_cast<unsigned char>('j')] = {Arg::Fixed, 4};     // LONG_BINGET
        ops[static_cast<unsigned char>('q')] = {Arg::Fixed, 1};     // BINPUT
        ops[static_cast<unsigned char>('r')] = {Arg::Fixed, 4};     // LONG_BINPUT
        ops[0x80] = {Arg::Fixed, 1};                                // PROTO
        ops[0x82] = {Arg::Fixed, 1};                                // EXT1
        ops[0x83] = {Arg::Fixed, 2};                                // EXT2
        ops[0x84] = {Arg::Fixed, 4};                                // EXT4
        ops[0x95] = {Arg::Fixed, 8};                                // FRAME: its opcodes follow inline
        ops[static_cast<unsigned char>('U')] = {Arg::Len1, 0};      // SHORT_BINSTRING
        ops[static_cast<unsigned char>('C')] = {Arg::Len1, 0};      // SHORT_BINBYTES
        ops[0x8a] = {Arg::Len1, 0};                                 // LONG1
        ops[0x8c] = {Arg::Len1, 0};                                 // SHORT_BINUNICODE
        ops[static_cast<unsigned char>('T')] = {Arg::Len4, 0};      // BINSTRING
        ops[static_cast<unsigned char>('X')] = {Arg::Len4, 0};      // BINUNICODE
        ops[static_cast<unsigned char>('B')] = {Arg::Len4, 0};      // BINBYTES
        ops[0x8b] = {Arg::Len4, 0};                                 // LONG4
        ops[0x8d] = {Arg::Len8, 0};                                 // BINUNICODE8
        ops[0x8e] = {Arg::Len8, 0};                                 // BINBYTES8
        ops[0x96] = {Arg::Len8, 0};                                 // BYTEARRAY8
        for (unsigned char c : "FILPSVgp")                          // protocol-0 text arguments
            if (c) ops[c] = {Arg::Line, 0};
        ops[static_cast<unsigned char>('c')] = {Arg::TwoLines, 0};  // GLOBAL
        ops[static_cast<unsigned char>('i')] = {Arg::TwoLines, 0};  // INST
    }
};

constexpr Table kTable;

uint64_t le(const uint8_t* p, unsigned n) {
    uint64_t v = 0;
    for (unsigned i = 0; i < n; ++i) v |= uint64_t{p[i]} << (8 * i);
    return v;
}

}  // namespace

PickleMemoScan scan_pickle_memo(const uint8_t* data, std::size_t len) noexcept {
    PickleMemoScan out;
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
        const Op op = kTable.ops[code];
        const std::size_t at = pos;
        const std::size_t left = len - pos - 1;
        const uint8_t* a = data + pos + 1;
        std::size_t arg = 0;
        switch (op.arg) {
            case Arg::Unknown:
                out.scanned = pos;
                return out;
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

}  // namespace pyckpt

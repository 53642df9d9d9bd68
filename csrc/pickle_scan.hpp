// A pre-pass over untrusted pickle bytes, before CPython's unpickler sees them.
//
// CPython's C unpickler sizes its memo array from the index an explicit memo store names
// (LONG_BINPUT / PUT): one 8-byte store of index 2^30 makes it allocate and zero 16 GiB. A real
// pickler numbers memo entries 0, 1, 2, ..., so an index beyond the number of stores before it
// is never legitimate; this walk finds the largest such index without unpickling anything. Length
// prefixes are checked too: a 16-byte BINBYTES8 claiming 2^62 bytes would be allocated first.
//
// The same walk finds the first opcode torch's weights-only unpickler does not implement. CPython
// reads any opcode, so such a pickle parses here, but a file copied verbatim must still load in
// torch.load(weights_only=True); one walk answers both questions.
//
// Thread/GIL contract: pure functions over a byte buffer; safe from any thread. No Python
// involvement.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyckpt {

struct PickleScan {
    uint64_t stores = 0;        // memo stores (PUT, BINPUT, LONG_BINPUT, MEMOIZE) before the first STOP
    int64_t max_index = -1;     // largest explicit index stored, -1 if none
    uint64_t max_index_at = 0;  // byte offset of that store
    uint64_t scanned = 0;       // bytes walked: up to STOP, an unknown opcode or a truncated argument
    // A length-prefixed argument (or FRAME) claiming more bytes than follow: the unpickler would
    // allocate the claimed size before finding out, so the caller refuses at `scanned`.
    bool overlong = false;
    // Byte offset of the first opcode outside torch_load_reads() (a byte that is no opcode at all
    // included), -1 if every opcode walked is one torch.save writes. Taken when the opcode byte is
    // read, so an opcode whose argument is then cut short still counts.
    int64_t disallowed_at = -1;
    uint8_t disallowed_op = 0;  // the byte at disallowed_at
};

// Walks opcodes (protocols 0-5) up to STOP. An unknown opcode or an argument running past the
// end ends the walk early: the unpickler fails at that point before reaching anything after it.
PickleScan scan_pickle(const uint8_t* data, std::size_t len) noexcept;

// pickletools' name of opcode `code` (the name Python-side messages and tests use), or nullptr
// for a byte that is no pickle opcode.
const char* pickle_opcode_name(uint8_t code) noexcept;

// Whether torch's weights-only unpickler implements opcode `code`. It covers every opcode
// torch.save writes (a protocol-2 pickle) and refuses the rest.
bool torch_load_reads(uint8_t code) noexcept;

}  // namespace pyckpt

// Element conversions applied while gathering tensor bytes: widening to float32 (Tensor.float()) and
// narrowing to bfloat16/float16 (Tensor.to(dtype)), little-endian, rounding to nearest even.
//
// Thread/GIL contract: pure functions over caller-owned memory; reentrant from any thread,
// never touch Python. Source pointers need no alignment.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyckpt {

// Values are part of the Python API (the `kind` column of an op row); never renumber.
enum Kind : int64_t {
    KIND_COPY = 0,
    KIND_BF16_TO_F32 = 1,
    KIND_F16_TO_F32 = 2,
    KIND_F64_TO_F32 = 3,
    KIND_I64_TO_F32 = 4,
    KIND_I32_TO_F32 = 5,
    KIND_I16_TO_F32 = 6,
    KIND_I8_TO_F32 = 7,
    KIND_U8_TO_F32 = 8,
    KIND_BOOL_TO_F32 = 9,
    KIND_F32_TO_BF16 = 10,
    KIND_F32_TO_F16 = 11,
    KIND_BF16_TO_F16 = 12,
    KIND_F16_TO_BF16 = 13,
    KIND_F64_TO_BF16 = 14,
    KIND_F64_TO_F16 = 15,
    KIND_COUNT = 16,
};

// Bytes per source element for `kind` (1 for KIND_COPY, whose unit is the byte).
uint32_t kind_src_itemsize(int64_t kind) noexcept;
// Bytes per destination element (1 for KIND_COPY, 4 to float32, 2 to bfloat16/float16).
uint32_t kind_dst_itemsize(int64_t kind) noexcept;
const char* kind_name(int64_t kind) noexcept;

// Converts `count` whole elements from `src` into `dst` (count * kind_dst_itemsize bytes).
// kind != KIND_COPY.
void convert_elements(int64_t kind, const uint8_t* src, uint8_t* dst, std::size_t count) noexcept;

// Writes bytes [begin, end) of the converted form of the element run starting at `src`
// (destination byte b belongs to element b / kind_dst_itemsize) to `dst`. Handles ranges that start or end in
// the middle of an element, which happens when a window boundary splits a float.
void convert_byte_range(int64_t kind, const uint8_t* src, uint64_t begin, uint64_t end, uint8_t* dst) noexcept;

// The CPU-independent fp16 path (used where F16C is missing); exposed so tests can check it
// on machines that would otherwise only run the hardware path.
void half_to_f32_portable(const uint8_t* src, uint8_t* dst, std::size_t count) noexcept;
void f32_to_half_portable(const uint8_t* src, uint8_t* dst, std::size_t count) noexcept;

}  // namespace pyckpt

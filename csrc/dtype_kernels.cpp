#include "dtype_kernels.hpp"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pyckpt {

namespace {

template <class T>
inline T load(const uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

// IEEE half -> single using integer ops plus one int->float conversion for subnormals, so
// the result does not depend on the thread's FTZ/DAZ mode (torch.set_flush_denormal may have
// set it, and new threads inherit it). NaNs come out quiet, matching torch's .float().
inline uint32_t half_to_f32_bits(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = h & 0x7c00u;
    uint32_t man = h & 0x03ffu;
    uint32_t normal = ((static_cast<uint32_t>(h & 0x7fffu)) << 13) + ((127u - 15u) << 23);
    uint32_t sub = f32_bits(static_cast<float>(static_cast<int32_t>(man)) * 0x1p-24f);
    uint32_t special = 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    uint32_t mag = exp == 0 ? sub : (exp == 0x7c00u ? special : normal);
    return sign | mag;
}

template <class Fn>
inline void convert_loop(const uint8_t* src, uint8_t* dst, std::size_t count, std::size_t in_size, Fn fn) {
    for (std::size_t i = 0; i < count; ++i) {
        uint32_t bits = fn(src + i * in_size);
        std::memcpy(dst + 4 * i, &bits, 4);
    }
}

}  // namespace

void half_to_f32_portable(const uint8_t* src, uint8_t* dst, std::size_t n) noexcept {
    convert_loop(src, dst, n, 2, [](const uint8_t* p) { return half_to_f32_bits(load<uint16_t>(p)); });
}

namespace {

// Single -> bfloat16, rounding to nearest even in integer arithmetic. NaNs become 0x7fc0, as
// torch's scalar conversion makes them (its vector path differs; tests compare NaNs as NaNs).
inline uint16_t f32_to_bf16_bits(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Single -> IEEE half, rounding to nearest even in integer arithmetic (so the thread's FTZ/DAZ
// mode cannot change it). NaNs stay NaN with the quiet bit set and the payload's top bits, as
// VCVTPS2PH makes them, so this and the F16C path agree bit for bit.
inline uint16_t f32_to_half_bits(uint32_t x) {
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    // 65520 (0x477ff000) lies halfway between the largest half, 65504, and 2^16; the tie goes to
    // the even neighbour, which is infinity.
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
    if (ax >= 0x38800000u) {  // a normal half: drop 13 mantissa bits, rebias the exponent 127 -> 15
        const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
        return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
    }
    if (ax <= 0x33000000u) return sign;  // at most 2^-25, half the smallest subnormal: ties to zero
    // A subnormal half counts units of 2^-24: the 24-bit significand shifted right, rounded.
    const uint32_t shift = 126u - (ax >> 23);  // 14..24
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // may carry into the smallest normal: right
    return static_cast<uint16_t>(sign | q);
}

template <class Fn>
inline void narrow_loop(const uint8_t* src, uint8_t* dst, std::size_t count, Fn fn) {
    for (std::size_t i = 0; i < count; ++i) {
        uint16_t bits = fn(load<uint32_t>(src + 4 * i));
        std::memcpy(dst + 2 * i, &bits, 2);
    }
}

}  // namespace

void f32_to_half_portable(const uint8_t* src, uint8_t* dst, std::size_t n) noexcept {
    narrow_loop(src, dst, n, f32_to_half_bits);
}

namespace {

#if defined(__x86_64__)
// VCVTPH2PS converts subnormals exactly, quiets NaNs like torch, and ignores MXCSR.DAZ, so it
// is bit-identical to the portable path (the tests check both against torch).
__attribute__((target("f16c,avx"))) void half_to_f32_f16c(const uint8_t* src, uint8_t* dst, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + 4 * i), _mm256_cvtph_ps(h));
    }
    half_to_f32_portable(src + 2 * i, dst + 4 * i, n - i);
}

// VCVTPS2PH with round-to-nearest-even: the portable path above reproduces it bit for bit.
__attribute__((target("f16c,avx"))) void f32_to_half_f16c(const uint8_t* src, uint8_t* dst, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
    f32_to_half_portable(src + 4 * i, dst + 2 * i, n - i);
}

using HalfFn = void (*)(const uint8_t*, uint8_t*, std::size_t);
bool has_f16c() { return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx"); }
HalfFn pick_half() { return has_f16c() ? half_to_f32_f16c : half_to_f32_portable; }
HalfFn pick_narrow_half() { return has_f16c() ? f32_to_half_f16c : f32_to_half_portable; }
#else
using HalfFn = void (*)(const uint8_t*, uint8_t*, std::size_t);
HalfFn pick_half() { return half_to_f32_portable; }
HalfFn pick_narrow_half() { return f32_to_half_portable; }
#endif

const HalfFn half_impl = pick_half();
const HalfFn narrow_half_impl = pick_narrow_half();

// The float32 form a narrowing conversion starts from, for sources that are not float32.
int64_t widening_of(int64_t kind) {
    switch (kind) {
        case KIND_BF16_TO_F16: return KIND_BF16_TO_F32;
        case KIND_F16_TO_BF16: return KIND_F16_TO_F32;
        case KIND_F64_TO_BF16:
        case KIND_F64_TO_F16: return KIND_F64_TO_F32;
        default: return KIND_COPY;  // the source is float32 already
    }
}

bool narrows_to_half(int64_t kind) {
    return kind == KIND_F32_TO_F16 || kind == KIND_BF16_TO_F16 || kind == KIND_F64_TO_F16;
}

}  // namespace

uint32_t kind_src_itemsize(int64_t kind) noexcept {
    switch (kind) {
        case KIND_BF16_TO_F32:
        case KIND_F16_TO_F32:
        case KIND_I16_TO_F32:
        case KIND_BF16_TO_F16:
        case KIND_F16_TO_BF16: return 2;
        case KIND_F64_TO_F32:
        case KIND_I64_TO_F32:
        case KIND_F64_TO_BF16:
        case KIND_F64_TO_F16: return 8;
        case KIND_I32_TO_F32:
        case KIND_F32_TO_BF16:
        case KIND_F32_TO_F16: return 4;
        default: return 1;
    }
}

uint32_t kind_dst_itemsize(int64_t kind) noexcept {
    if (kind == KIND_COPY) return 1;
    return kind >= KIND_F32_TO_BF16 ? 2 : 4;
}

const char* kind_name(int64_t kind) noexcept {
    static const char* const names[] = {"copy",      "bf16->f32", "f16->f32",  "f64->f32",  "i64->f32",  "i32->f32",
                                        "i16->f32",  "i8->f32",   "u8->f32",   "bool->f32", "f32->bf16", "f32->f16",
                                        "bf16->f16", "f16->bf16", "f64->bf16", "f64->f16"};
    static_assert(sizeof(names) / sizeof(names[0]) == KIND_COUNT, "one name per kind");
    return kind >= 0 && kind < KIND_COUNT ? names[kind] : "?";
}

namespace {

// Narrowing in chunks: non-float32 sources are widened into a small buffer first (exactly, or
// for float64 with one rounding, as torch converts a double to a 16-bit float via float).
void narrow_elements(int64_t kind, const uint8_t* s, uint8_t* d, std::size_t n) noexcept {
    constexpr std::size_t kChunk = 256;
    alignas(32) uint8_t wide[kChunk * 4];
    const int64_t widen = widening_of(kind);
    const uint32_t in = kind_src_itemsize(kind);
    for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i);
        const uint8_t* f32 = s + i * in;
        if (widen != KIND_COPY) {
            convert_elements(widen, f32, wide, m);
            f32 = wide;
        }
        if (narrows_to_half(kind))
            narrow_half_impl(f32, d + 2 * i, m);
        else
            narrow_loop(f32, d + 2 * i, m, f32_to_bf16_bits);
    }
}

}  // namespace

void convert_elements(int64_t kind, const uint8_t* s, uint8_t* d, std::size_t n) noexcept {
    switch (kind) {
        case KIND_BF16_TO_F32:
            convert_loop(s, d, n, 2, [](const uint8_t* p) { return static_cast<uint32_t>(load<uint16_t>(p)) << 16; });
            break;
        case KIND_F16_TO_F32:
            half_impl(s, d, n);
            break;
        case KIND_F64_TO_F32:
            convert_loop(s, d, n, 8, [](const uint8_t* p) { return f32_bits(static_cast<float>(load<double>(p))); });
            break;
        case KIND_I64_TO_F32:
            convert_loop(s, d, n, 8, [](const uint8_t* p) { return f32_bits(static_cast<float>(load<int64_t>(p))); });
            break;
        case KIND_I32_TO_F32:
            convert_loop(s, d, n, 4, [](const uint8_t* p) { return f32_bits(static_cast<float>(load<int32_t>(p))); });
            break;
        case KIND_I16_TO_F32:
            convert_loop(s, d, n, 2, [](const uint8_t* p) { return f32_bits(static_cast<float>(load<int16_t>(p))); });
            break;
        case KIND_I8_TO_F32:
            convert_loop(s, d, n, 1, [](const uint8_t* p) { return f32_bits(static_cast<float>(load<int8_t>(p))); });
            break;
        case KIND_U8_TO_F32:
            convert_loop(s, d, n, 1, [](const uint8_t* p) { return f32_bits(static_cast<float>(*p)); });
            break;
        case KIND_BOOL_TO_F32:
            convert_loop(s, d, n, 1, [](const uint8_t* p) { return *p ? 0x3f800000u : 0u; });
            break;
        case KIND_F32_TO_BF16:
        case KIND_F32_TO_F16:
        case KIND_BF16_TO_F16:
        case KIND_F16_TO_BF16:
        case KIND_F64_TO_BF16:
        case KIND_F64_TO_F16:
            narrow_elements(kind, s, d, n);
            break;
        default: break;
    }
}

void convert_byte_range(int64_t kind, const uint8_t* src, uint64_t begin, uint64_t end, uint8_t* dst) noexcept {
    if (begin >= end) return;
    const uint32_t in = kind_src_itemsize(kind);
    const uint32_t out_size = kind_dst_itemsize(kind);
    uint64_t first = begin / out_size, last = (end + out_size - 1) / out_size;  // elements touched
    uint64_t full_lo = (begin + out_size - 1) / out_size, full_hi = end / out_size;  // elements fully inside
    uint8_t tmp[4];
    if (full_lo > full_hi) {  // the whole range lies inside one element
        convert_elements(kind, src + first * in, tmp, 1);
        std::memcpy(dst, tmp + (begin % out_size), end - begin);
        return;
    }
    uint8_t* out = dst;
    if (first < full_lo) {
        convert_elements(kind, src + first * in, tmp, 1);
        std::memcpy(out, tmp + (begin % out_size), out_size - begin % out_size);
        out += out_size - begin % out_size;
    }
    convert_elements(kind, src + full_lo * in, out, full_hi - full_lo);
    out += out_size * (full_hi - full_lo);
    if (full_hi < last) {
        convert_elements(kind, src + full_hi * in, tmp, 1);
        std::memcpy(out, tmp, end % out_size);
    }
}

}  // namespace pyckpt

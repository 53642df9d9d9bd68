#include "convert.hpp"

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

using HalfFn = void (*)(const uint8_t*, uint8_t*, std::size_t);
HalfFn pick_half() {
    if (__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx")) return half_to_f32_f16c;
    return half_to_f32_portable;
}
#else
using HalfFn = void (*)(const uint8_t*, uint8_t*, std::size_t);
HalfFn pick_half() { return half_to_f32_portable; }
#endif

const HalfFn half_impl = pick_half();

}  // namespace

uint32_t kind_src_itemsize(int64_t kind) noexcept {
    switch (kind) {
        case KIND_BF16_TO_F32:
        case KIND_F16_TO_F32:
        case KIND_I16_TO_F32: return 2;
        case KIND_F64_TO_F32:
        case KIND_I64_TO_F32: return 8;
        case KIND_I32_TO_F32: return 4;
        default: return 1;
    }
}

uint32_t kind_dst_itemsize(int64_t kind) noexcept { return kind == KIND_COPY ? 1 : 4; }

const char* kind_name(int64_t kind) noexcept {
    static const char* const names[] = {"copy",        "bf16->f32", "f16->f32",  "f64->f32", "i64->f32",
                                        "i32->f32",    "i16->f32",  "i8->f32",   "u8->f32",  "bool->f32"};
    return kind >= 0 && kind < KIND_COUNT ? names[kind] : "?";
}

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
        default: break;
    }
}

void convert_byte_range(int64_t kind, const uint8_t* src, uint64_t begin, uint64_t end, uint8_t* dst) noexcept {
    if (begin >= end) return;
    const uint32_t in = kind_src_itemsize(kind);
    uint64_t first = begin / 4, last = (end + 3) / 4;  // elements touched
    uint64_t full_lo = (begin + 3) / 4, full_hi = end / 4;  // elements fully inside
    uint8_t tmp[4];
    if (full_lo > full_hi) {  // the whole range lies inside one element
        convert_elements(kind, src + first * in, tmp, 1);
        std::memcpy(dst, tmp + (begin % 4), end - begin);
        return;
    }
    uint8_t* out = dst;
    if (first < full_lo) {
        convert_elements(kind, src + first * in, tmp, 1);
        std::memcpy(out, tmp + (begin % 4), 4 - begin % 4);
        out += 4 - begin % 4;
    }
    convert_elements(kind, src + full_lo * in, out, full_hi - full_lo);
    out += 4 * (full_hi - full_lo);
    if (full_hi < last) {
        convert_elements(kind, src + full_hi * in, tmp, 1);
        std::memcpy(out, tmp, end % 4);
    }
}

}  // namespace pyckpt

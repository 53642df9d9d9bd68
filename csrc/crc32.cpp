#include "crc32.hpp"

#include <array>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#define PYCKPT_X86 1
#include <immintrin.h>
// GCC 12's AVX-512 intrinsic headers trip -Wmaybe-uninitialized on their own "undefined"
// placeholders; the warning says nothing about this file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pyckpt {
namespace {

constexpr uint32_t kPoly = 0xEDB88320u;

// table[k][b]: register contribution of byte b followed by k zero bytes, so 16 bytes can be
// folded with 16 independent lookups instead of a 16-step dependency chain.
using Tables = std::array<std::array<uint32_t, 256>, 16>;

constexpr Tables make_tables() {
    Tables t{};
    for (uint32_t b = 0; b < 256; ++b) {
        uint32_t r = b;
        for (int i = 0; i < 8; ++i) r = (r & 1) ? (r >> 1) ^ kPoly : r >> 1;
        t[0][b] = r;
    }
    for (int k = 1; k < 16; ++k)
        for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
    return t;
}

constexpr Tables kTables = make_tables();

inline uint64_t load_le64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;  // little-endian hosts only (checked in executor.cpp)
}

// Register-level update without the pre/post inversion; the folding code needs this raw form.
uint32_t raw_slice16(uint32_t r, const uint8_t* p, std::size_t n) noexcept {
    const auto& t = kTables;
    while (n >= 16) {
        uint64_t a = load_le64(p) ^ r;
        uint64_t b = load_le64(p + 8);
        r = t[15][a & 0xff] ^ t[14][(a >> 8) & 0xff] ^ t[13][(a >> 16) & 0xff] ^
            t[12][(a >> 24) & 0xff] ^ t[11][(a >> 32) & 0xff] ^ t[10][(a >> 40) & 0xff] ^
            t[9][(a >> 48) & 0xff] ^ t[8][a >> 56] ^ t[7][b & 0xff] ^ t[6][(b >> 8) & 0xff] ^
            t[5][(b >> 16) & 0xff] ^ t[4][(b >> 24) & 0xff] ^ t[3][(b >> 32) & 0xff] ^
            t[2][(b >> 40) & 0xff] ^ t[1][(b >> 48) & 0xff] ^ t[0][b >> 56];
        p += 16;
        n -= 16;
    }
    while (n--) r = (r >> 8) ^ t[0][(r ^ *p++) & 0xff];
    return r;
}

uint32_t crc_table(uint32_t crc, const uint8_t* p, std::size_t n) noexcept {
    return ~raw_slice16(~crc, p, n);
}

// --- GF(2) arithmetic modulo P in the reflected representation (bit i <-> x^(31-i)) ---------

uint32_t mul_mod_p(uint32_t a, uint32_t b) noexcept {
    uint32_t prod = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m) prod ^= b;
        b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
    }
    return prod;
}

struct Powers {
    uint32_t x2k[64];  // x^(2^k) mod P
    Powers() {
        x2k[0] = 1u << 30;  // x^1
        for (int k = 1; k < 64; ++k) x2k[k] = mul_mod_p(x2k[k - 1], x2k[k - 1]);
    }
};

const Powers& powers() {
    static const Powers p;
    return p;
}

// x^n mod P; n is a bit count, so 64 squarings cover any byte length we can address.
uint32_t x_pow_mod_p(uint64_t n) noexcept {
    const Powers& p = powers();
    uint32_t r = 1u << 31;  // x^0
    for (int k = 0; n; ++k, n >>= 1)
        if (n & 1) r = mul_mod_p(r, p.x2k[k]);
    return r;
}

#ifdef PYCKPT_X86

// Folding constants in the layout PCLMULQDQ needs: the 32-bit reflected remainder placed so
// that bit i of the qword stands for x^(32-i). Folding a 128-bit lane forward by d bits
// multiplies its high-degree half (low qword) by x^(d+32) and its low-degree half by x^(d-32).
uint64_t fold_const(uint64_t exponent) { return static_cast<uint64_t>(x_pow_mod_p(exponent)) << 1; }

struct FoldConsts {
    uint64_t k128_lo, k128_hi, k512_lo, k512_hi, k2048_lo, k2048_hi;
    FoldConsts()
        : k128_lo(fold_const(128 + 32)),
          k128_hi(fold_const(128 - 32)),
          k512_lo(fold_const(512 + 32)),
          k512_hi(fold_const(512 - 32)),
          k2048_lo(fold_const(2048 + 32)),
          k2048_hi(fold_const(2048 - 32)) {}
};

const FoldConsts& fold_consts() {
    static const FoldConsts c;
    return c;
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i fold128(__m128i acc, __m128i k,
                                                                  __m128i next) {
    __m128i hi = _mm_clmulepi64_si128(acc, k, 0x00);
    __m128i lo = _mm_clmulepi64_si128(acc, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(hi, lo), next);
}

// Reduces the folded 128-bit remainder by running it through the table code as if it were 16
// message bytes: it is congruent to everything consumed so far, so no Barrett step is needed.
__attribute__((target("pclmul,sse4.1"))) uint32_t finish_fold(__m128i acc, const uint8_t* p,
                                                              std::size_t n) noexcept {
    const FoldConsts& c = fold_consts();
    const __m128i k128 = _mm_set_epi64x(static_cast<long long>(c.k128_hi),
                                        static_cast<long long>(c.k128_lo));
    while (n >= 16) {
        acc = fold128(acc, k128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        p += 16;
        n -= 16;
    }
    alignas(16) uint8_t rem[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(rem), acc);
    uint32_t r = raw_slice16(0, rem, 16);
    return ~raw_slice16(r, p, n);
}

__attribute__((target("pclmul,sse4.1"))) uint32_t crc_pclmul(uint32_t crc, const uint8_t* p,
                                                             std::size_t n) noexcept {
    if (n < 128) return crc_table(crc, p, n);
    const FoldConsts& c = fold_consts();
    const __m128i k512 = _mm_set_epi64x(static_cast<long long>(c.k512_hi),
                                        static_cast<long long>(c.k512_lo));
    const __m128i k128 = _mm_set_epi64x(static_cast<long long>(c.k128_hi),
                                        static_cast<long long>(c.k128_lo));
#define ld(q) _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))
    // XOR-ing the inverted register into the first message bits is equivalent to starting the
    // division with it.
    __m128i x0 = _mm_xor_si128(ld(p), _mm_cvtsi32_si128(static_cast<int>(~crc)));
    __m128i x1 = ld(p + 16), x2 = ld(p + 32), x3 = ld(p + 48);
    p += 64;
    n -= 64;
    while (n >= 64) {
        x0 = fold128(x0, k512, ld(p));
        x1 = fold128(x1, k512, ld(p + 16));
        x2 = fold128(x2, k512, ld(p + 32));
        x3 = fold128(x3, k512, ld(p + 48));
        p += 64;
        n -= 64;
    }
    x1 = fold128(x0, k128, x1);
    x2 = fold128(x1, k128, x2);
    x3 = fold128(x2, k128, x3);
#undef ld
    return finish_fold(x3, p, n);
}

#define PYCKPT_VPCLMUL_TARGET __attribute__((target("vpclmulqdq,avx512f,avx512vl,pclmul,sse4.1")))

PYCKPT_VPCLMUL_TARGET inline __m512i fold512(__m512i acc, __m512i k, __m512i next) {
    __m512i hi = _mm512_clmulepi64_epi128(acc, k, 0x00);
    __m512i lo = _mm512_clmulepi64_epi128(acc, k, 0x11);
    return _mm512_ternarylogic_epi64(hi, lo, next, 0x96);  // three-way XOR
}

// Same scheme with four 512-bit accumulators (256 bytes per iteration), for CPUs whose
// wide carry-less multiplier makes the 128-bit loop the bottleneck.
PYCKPT_VPCLMUL_TARGET uint32_t crc_vpclmul(uint32_t crc, const uint8_t* p, std::size_t n) noexcept {
    if (n < 512) return crc_pclmul(crc, p, n);
    const FoldConsts& c = fold_consts();
    // Lambdas would not inherit this function's target attribute, so build constants inline.
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(
        static_cast<long long>(c.k2048_hi), static_cast<long long>(c.k2048_lo)));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(
        static_cast<long long>(c.k512_hi), static_cast<long long>(c.k512_lo)));
#define ld(q) _mm512_loadu_si512(q)
    __m512i x0 = _mm512_xor_si512(ld(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc))));
    __m512i x1 = ld(p + 64), x2 = ld(p + 128), x3 = ld(p + 192);
    p += 256;
    n -= 256;
    while (n >= 256) {
        x0 = fold512(x0, k2048, ld(p));
        x1 = fold512(x1, k2048, ld(p + 64));
        x2 = fold512(x2, k2048, ld(p + 128));
        x3 = fold512(x3, k2048, ld(p + 192));
        p += 256;
        n -= 256;
    }
    x1 = fold512(x0, k512, x1);
    x2 = fold512(x1, k512, x2);
    x3 = fold512(x2, k512, x3);
    const __m128i k128 = _mm_set_epi64x(static_cast<long long>(c.k128_hi),
                                        static_cast<long long>(c.k128_lo));
    __m128i a = _mm512_castsi512_si128(x3);
    a = fold128(a, k128, _mm512_extracti32x4_epi32(x3, 1));
    a = fold128(a, k128, _mm512_extracti32x4_epi32(x3, 2));
    a = fold128(a, k128, _mm512_extracti32x4_epi32(x3, 3));
#undef ld
    return finish_fold(a, p, n);
}

bool have_pclmul() { return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"); }
bool have_vpclmul() {
    return have_pclmul() && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}

#endif  // PYCKPT_X86

using CrcFn = uint32_t (*)(uint32_t, const uint8_t*, std::size_t) noexcept;

CrcFn lookup(const std::string& name) {
    if (name == "table") return crc_table;
#ifdef PYCKPT_X86
    if (name == "pclmul" && have_pclmul()) return crc_pclmul;
    if (name == "vpclmul" && have_vpclmul()) return crc_vpclmul;
#endif
    return nullptr;
}

struct Active {
    CrcFn fn;
    std::string name;
    Active() {
        auto names = crc32_implementations();
        name = names.back();
        if (const char* env = std::getenv("PYCKPT_CRC32_IMPL")) {
            // An unusable override falls back to the best choice rather than failing imports.
            if (lookup(env)) name = env;
        }
        fn = lookup(name);
    }
};

const Active& active() {
    static const Active a;
    return a;
}

}  // namespace

uint32_t crc32(uint32_t crc, const void* data, std::size_t len) noexcept {
    return active().fn(crc, static_cast<const uint8_t*>(data), len);
}

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) noexcept {
    return mul_mod_p(x_pow_mod_p(len_b * 8), crc_a) ^ crc_b;
}

uint32_t crc32_zeros(uint32_t crc, uint64_t len) noexcept {
    // A zero byte only shifts the raw register, i.e. multiplies it by x^8.
    return ~mul_mod_p(x_pow_mod_p(len * 8), ~crc);
}

std::vector<std::string> crc32_implementations() {
    std::vector<std::string> out{"table"};
#ifdef PYCKPT_X86
    if (have_pclmul()) out.emplace_back("pclmul");
    if (have_vpclmul()) out.emplace_back("vpclmul");
#endif
    return out;
}

std::string crc32_active_implementation() { return active().name; }

uint32_t crc32_with(const std::string& impl, uint32_t crc, const void* data, std::size_t len) {
    CrcFn fn = lookup(impl);
    if (!fn) throw std::invalid_argument("crc32 implementation not available on this CPU: " + impl);
    return fn(crc, static_cast<const uint8_t*>(data), len);
}

}  // namespace pyckpt

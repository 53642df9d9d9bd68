// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), bit-compatible with zlib.crc32.
//
// Thread/GIL contract: all functions are pure and reentrant; call them from any thread, with or
// without the GIL (they never touch Python). The implementation is chosen once, at first use,
// from the CPU's features (override with PYCKPT_CRC32_IMPL=table|pclmul|vpclmul for benchmarks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pyckpt {

// crc32(data) continuing from `crc` (0 for a fresh checksum), same convention as zlib.
uint32_t crc32(uint32_t crc, const void* data, std::size_t len) noexcept;

// CRC of A||B from crc(A), crc(B) and len(B): lets workers checksum windows independently.
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) noexcept;

// crc32 continued over `len` zero bytes, in O(log len) time (for sparse zero-filled windows).
uint32_t crc32_zeros(uint32_t crc, uint64_t len) noexcept;

// Names of the implementations this CPU can run, best last, and a way to run a specific one
// (tests compare every implementation against zlib). Throws std::invalid_argument on an
// unknown or unsupported name.
std::vector<std::string> crc32_implementations();
std::string crc32_active_implementation();
uint32_t crc32_with(const std::string& impl, uint32_t crc, const void* data, std::size_t len);

}  // namespace pyckpt

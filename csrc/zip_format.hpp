// ZIP record layouts (stored members only) as torch.save writes them: every member's data
// starts at a multiple of 64 thanks to an "FB" padding extra field in its local header.
//
// Thread/GIL contract: pure functions and value types; reentrant, callable from any thread,
// never touch Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace pyckpt::zip {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kEocd64Sig = 0x06064b50;
constexpr uint32_t kEocd64LocatorSig = 0x07064b50;
constexpr std::size_t kLocalHeaderSize = 30;
constexpr std::size_t kCentralHeaderSize = 46;
constexpr std::size_t kEocdSize = 22;
constexpr std::size_t kEocd64Size = 56;
constexpr std::size_t kEocd64LocatorSize = 20;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint16_t kPadExtraId = 0x4246;  // "FB", the id torch uses for alignment padding
constexpr uint32_t kMax32 = 0xFFFFFFFFu;
constexpr uint16_t kMax16 = 0xFFFFu;
constexpr uint64_t kAlignment = 64;  // torch's .storage_alignment

inline uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
inline uint32_t rd32(const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
           (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
inline uint64_t rd64(const uint8_t* p) {
    return static_cast<uint64_t>(rd32(p)) | (static_cast<uint64_t>(rd32(p + 4)) << 32);
}

// Little-endian fields appended to a header being built, and the ZIP64 threshold: a size or an
// offset that does not fit 32 bits is stored as 0xFFFFFFFF and given in a ZIP64 field.
inline void put16(std::string& s, uint16_t v) {
    s.push_back(static_cast<char>(v & 0xff));
    s.push_back(static_cast<char>(v >> 8));
}
inline void put32(std::string& s, uint32_t v) {
    for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put64(std::string& s, uint64_t v) {
    for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline bool big(uint64_t v) { return v >= kMax32; }
inline uint32_t clamp32(uint64_t v) { return big(v) ? kMax32 : static_cast<uint32_t>(v); }

// The end of an archive after its central directory (n entries, cd_size bytes at cd_offset): the
// ZIP64 end record and its locator when `zip64`, made by/needing the versions given, then the end
// record, whose 16/32-bit fields hold the true values where they fit and the ZIP64 marker otherwise
// (or always, with `force_marker`).
void append_end_records(std::string& out, uint64_t n, uint64_t cd_size, uint64_t cd_offset, bool zip64,
                        uint16_t made_by, uint16_t needed, bool force_marker);

// Placement of one member inside an archive being written.
struct EntryLayout {
    uint64_t header_offset = 0;  // local header start
    uint64_t data_offset = 0;    // first data byte (multiple of kAlignment)
    uint64_t size = 0;
    uint16_t local_extra_len = 0;
    bool zip64_local = false;  // local header carries a ZIP64 size extra
    // torch.save's exact layout only (plan_torch_save): the header offset does not fit 32 bits,
    // and the length of the data descriptor that follows the data (0: none).
    bool big_offset = false;
    uint16_t descriptor_len = 0;
};

struct ArchiveLayout {
    std::vector<EntryLayout> entries;
    uint64_t cd_offset = 0;
    uint64_t cd_size = 0;
    uint64_t file_size = 0;
    bool zip64_end = false;  // ZIP64 end record + locator present
    bool force_zip64 = false;
};

// One archive of a series written back to back into one file (Container::TorchZipSeries):
// `local` counts from the archive's first byte, which is `base` in the file.
struct SeriesPart {
    uint64_t base = 0;
    std::size_t first = 0;  // index of its first record in the output
    ArchiveLayout local;
};

// Computes where every header and data block goes. `names` are full member names.
// Throws std::invalid_argument for names longer than the format allows.
ArchiveLayout plan_archive(const std::vector<std::string>& names, const std::vector<uint64_t>& sizes,
                           bool force_zip64);

// The archives of a series (each starting at a record of `starts`, ascending from 0), each laid
// out on its own and placed after the previous one on a kAlignment boundary. `whole` gets every
// record's absolute offsets and the file's size.
std::vector<SeriesPart> plan_series(const std::vector<std::string>& names, const std::vector<uint64_t>& sizes,
                                    const std::vector<std::size_t>& starts, bool force_zip64, ArchiveLayout& whole);

// Appends the local header (signature through padding) of one entry.
void append_local_header(std::string& out, const std::string& name, const EntryLayout& e,
                         uint32_t crc);

// Central directory plus end records, to be written at layout.cd_offset.
std::string build_central_directory(const std::vector<std::string>& names, const ArchiveLayout& layout,
                                    const std::vector<uint32_t>& crcs);

}  // namespace pyckpt::zip

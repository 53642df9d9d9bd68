#include "zip_format.hpp"

#include <stdexcept>

namespace pyckpt::zip {

namespace {

// 1980-01-01 00:00 in MS-DOS format: the earliest valid date, so readers that decode the
// timestamp do not see month/day 0 and the output is byte-for-byte reproducible.
constexpr uint16_t kDosTime = 0;
constexpr uint16_t kDosDate = (0 << 9) | (1 << 5) | 1;
constexpr uint16_t kVersion20 = 20;
constexpr uint16_t kVersion45 = 45;  // needed to read ZIP64 structures
constexpr uint16_t kFlagUtf8 = 0x0800;


// Which ZIP64 fields a central-directory entry needs (the spec lists them in this order and
// only includes those whose 32-bit slot holds 0xFFFFFFFF).
struct CentralZip64 {
    bool sizes, offset;
    uint16_t extra_len() const { return (sizes || offset) ? 4 + (sizes ? 16 : 0) + (offset ? 8 : 0) : 0; }
};

CentralZip64 central_zip64(const EntryLayout& e, bool force) {
    return {force || big(e.size), force || big(e.header_offset)};
}

}  // namespace

ArchiveLayout plan_archive(const std::vector<std::string>& names, const std::vector<uint64_t>& sizes,
                           bool force_zip64) {
    if (names.size() != sizes.size()) throw std::invalid_argument("plan_archive: names/sizes mismatch");
    ArchiveLayout L;
    L.force_zip64 = force_zip64;
    L.entries.resize(names.size());
    uint64_t cur = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
        if (names[i].size() > kMax16) throw std::invalid_argument("member name too long: " + names[i]);
        EntryLayout& e = L.entries[i];
        e.header_offset = cur;
        e.size = sizes[i];
        e.zip64_local = force_zip64 || big(sizes[i]);
        uint64_t fixed = kLocalHeaderSize + names[i].size() + (e.zip64_local ? 20 : 0) + 4;
        uint64_t pad = (kAlignment - (cur + fixed) % kAlignment) % kAlignment;
        e.local_extra_len = static_cast<uint16_t>((e.zip64_local ? 20 : 0) + 4 + pad);
        e.data_offset = cur + fixed + pad;
        cur = e.data_offset + e.size;
    }
    L.cd_offset = cur;
    for (std::size_t i = 0; i < names.size(); ++i)
        L.cd_size += kCentralHeaderSize + names[i].size() + central_zip64(L.entries[i], force_zip64).extra_len();
    L.zip64_end = force_zip64 || names.size() >= kMax16 || big(L.cd_offset) || big(L.cd_size);
    L.file_size = L.cd_offset + L.cd_size + (L.zip64_end ? kEocd64Size + kEocd64LocatorSize : 0) + kEocdSize;
    return L;
}

std::vector<SeriesPart> plan_series(const std::vector<std::string>& names, const std::vector<uint64_t>& sizes,
                                    const std::vector<std::size_t>& starts, bool force_zip64, ArchiveLayout& whole) {
    if (names.size() != sizes.size()) throw std::invalid_argument("plan_series: names/sizes mismatch");
    std::vector<SeriesPart> parts(starts.size());
    whole = ArchiveLayout{};
    whole.entries.resize(names.size());
    uint64_t at = 0;
    for (std::size_t k = 0; k < parts.size(); ++k) {
        const std::size_t first = starts[k];
        const std::size_t end = k + 1 < parts.size() ? starts[k + 1] : names.size();
        if (first >= end || end > names.size()) throw std::invalid_argument("plan_series: starts must ascend");
        parts[k].first = first;
        parts[k].base = (at + kAlignment - 1) / kAlignment * kAlignment;
        parts[k].local = plan_archive(std::vector<std::string>(names.begin() + first, names.begin() + end),
                                      std::vector<uint64_t>(sizes.begin() + first, sizes.begin() + end), force_zip64);
        for (std::size_t r = first; r < end; ++r) {
            whole.entries[r] = parts[k].local.entries[r - first];
            whole.entries[r].header_offset += parts[k].base;
            whole.entries[r].data_offset += parts[k].base;
        }
        if (parts[k].local.file_size > UINT64_MAX / 4 || parts[k].base > UINT64_MAX / 4)
            throw std::invalid_argument("plan_series: a series larger than 2^62 bytes");
        at = parts[k].base + parts[k].local.file_size;
    }
    whole.file_size = at;
    return parts;
}

void append_local_header(std::string& out, const std::string& name, const EntryLayout& e,
                         uint32_t crc) {
    put32(out, kLocalSig);
    put16(out, e.zip64_local ? kVersion45 : kVersion20);
    put16(out, kFlagUtf8);
    put16(out, 0);  // stored
    put16(out, kDosTime);
    put16(out, kDosDate);
    put32(out, crc);
    put32(out, e.zip64_local ? kMax32 : static_cast<uint32_t>(e.size));
    put32(out, e.zip64_local ? kMax32 : static_cast<uint32_t>(e.size));
    put16(out, static_cast<uint16_t>(name.size()));
    put16(out, e.local_extra_len);
    out.append(name);
    uint16_t pad_payload = e.local_extra_len - 4;
    if (e.zip64_local) {
        put16(out, kZip64ExtraId);
        put16(out, 16);
        put64(out, e.size);
        put64(out, e.size);
        pad_payload -= 20;
    }
    put16(out, kPadExtraId);
    put16(out, pad_payload);
    out.append(pad_payload, 'Z');  // torch pads with 'Z'; any byte would do
}

void append_end_records(std::string& out, uint64_t n, uint64_t cd_size, uint64_t cd_offset, bool zip64,
                        uint16_t made_by, uint16_t needed, bool force_marker) {
    if (zip64) {
        put32(out, kEocd64Sig);
        put64(out, kEocd64Size - 12);  // size of the rest of this record
        put16(out, made_by);
        put16(out, needed);
        put32(out, 0);
        put32(out, 0);
        put64(out, n);
        put64(out, n);
        put64(out, cd_size);
        put64(out, cd_offset);
        put32(out, kEocd64LocatorSig);
        put32(out, 0);
        put64(out, cd_offset + cd_size);  // where the ZIP64 end record starts
        put32(out, 1);
    }
    const uint16_t entries = n >= kMax16 || force_marker ? kMax16 : static_cast<uint16_t>(n);
    put32(out, kEocdSig);
    put16(out, 0);
    put16(out, 0);
    put16(out, entries);
    put16(out, entries);
    put32(out, force_marker ? kMax32 : clamp32(cd_size));
    put32(out, force_marker ? kMax32 : clamp32(cd_offset));
    put16(out, 0);
}

std::string build_central_directory(const std::vector<std::string>& names, const ArchiveLayout& L,
                                    const std::vector<uint32_t>& crcs) {
    std::string out;
    out.reserve(L.file_size - L.cd_offset);
    for (std::size_t i = 0; i < names.size(); ++i) {
        const EntryLayout& e = L.entries[i];
        CentralZip64 z = central_zip64(e, L.force_zip64);
        bool any64 = z.sizes || z.offset;
        put32(out, kCentralSig);
        put16(out, any64 ? kVersion45 : kVersion20);  // made by (MS-DOS attrs)
        put16(out, any64 ? kVersion45 : kVersion20);  // needed to extract
        put16(out, kFlagUtf8);
        put16(out, 0);
        put16(out, kDosTime);
        put16(out, kDosDate);
        put32(out, crcs[i]);
        put32(out, z.sizes ? kMax32 : static_cast<uint32_t>(e.size));
        put32(out, z.sizes ? kMax32 : static_cast<uint32_t>(e.size));
        put16(out, static_cast<uint16_t>(names[i].size()));
        put16(out, z.extra_len());
        put16(out, 0);  // comment
        put16(out, 0);  // disk
        put16(out, 0);  // internal attrs
        put32(out, 0);  // external attrs
        put32(out, z.offset ? kMax32 : static_cast<uint32_t>(e.header_offset));
        out.append(names[i]);
        if (any64) {
            put16(out, kZip64ExtraId);
            put16(out, static_cast<uint16_t>(z.extra_len() - 4));
            if (z.sizes) {
                put64(out, e.size);
                put64(out, e.size);
            }
            if (z.offset) put64(out, e.header_offset);
        }
    }
    append_end_records(out, names.size(), L.cd_size, L.cd_offset, L.zip64_end, kVersion45, kVersion45, L.force_zip64);
    return out;
}

}  // namespace pyckpt::zip


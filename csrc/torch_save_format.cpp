#include "torch_save_format.hpp"

#include <cstdio>
#include <functional>
#include <stdexcept>
#include <unordered_set>

namespace pyckpt::zip {

namespace {

constexpr uint16_t kFlagDescriptor = 0x0008;
constexpr uint16_t kFlagUtf8 = 0x0800;
constexpr uint32_t kDescriptorSig = 0x08074b50;
constexpr uint16_t kEndMadeBy = 0x031e;  // UNIX, spec 3.0, as miniz writes its ZIP64 end record
constexpr uint16_t kEndNeeded = 45;


uint16_t local_zip64_len(const EntryLayout& e) {
    const bool big_size = big(e.size);
    return (big_size || e.big_offset) ? static_cast<uint16_t>(4 + (big_size ? 16 : 0) + (e.big_offset ? 8 : 0)) : 0;
}

uint16_t central_zip64_len(const EntryLayout& e) { return local_zip64_len(e); }

// c10::hash_combine, the mixing torch applies to both halves of the serialization id.
uint64_t hash_combine(uint64_t seed, uint64_t value) {
    return seed ^ (value + 0x9e3779b9u + (seed << 6) + (seed >> 2));
}

}  // namespace

ArchiveLayout plan_torch_save(const std::vector<std::string>& names, const std::vector<uint64_t>& sizes) {
    if (names.size() != sizes.size()) throw std::invalid_argument("plan_torch_save: names/sizes mismatch");
    ArchiveLayout L;
    L.entries.resize(names.size());
    uint64_t cur = 0;
    for (std::size_t i = 0; i < names.size(); ++i) {
        if (names[i].size() > kMax16) throw std::invalid_argument("member name too long: " + names[i]);
        EntryLayout& e = L.entries[i];
        e.header_offset = cur;
        e.size = sizes[i];
        e.big_offset = big(cur);
        e.zip64_local = big(e.size) || e.big_offset;
        const uint16_t z64 = local_zip64_len(e);
        const uint64_t fixed = kLocalHeaderSize + names[i].size() + z64 + 4;
        const uint64_t pad = (kAlignment - (cur + fixed) % kAlignment) % kAlignment;
        e.local_extra_len = static_cast<uint16_t>(z64 + 4 + pad);
        e.data_offset = cur + fixed + pad;
        // miniz writes no descriptor for an empty member (and leaves flag bit 3 clear)
        e.descriptor_len = e.size == 0 ? 0 : e.zip64_local ? 24 : 16;
        if (e.size > UINT64_MAX / 4 || e.data_offset > UINT64_MAX / 4)
            throw std::invalid_argument("plan_torch_save: an archive larger than 2^62 bytes");
        cur = e.data_offset + e.size + e.descriptor_len;
    }
    L.cd_offset = cur;
    for (std::size_t i = 0; i < names.size(); ++i)
        L.cd_size += kCentralHeaderSize + names[i].size() + central_zip64_len(L.entries[i]);
    L.zip64_end = true;
    L.file_size = L.cd_offset + L.cd_size + kEocd64Size + kEocd64LocatorSize + kEocdSize;
    return L;
}

static uint16_t flags(const EntryLayout& e) { return e.descriptor_len ? kFlagUtf8 | kFlagDescriptor : kFlagUtf8; }

void append_torch_save_local_header(std::string& out, const std::string& name, const EntryLayout& e) {
    put32(out, kLocalSig);
    put16(out, 0);  // version needed: miniz writes 0 for stored members
    put16(out, flags(e));
    put16(out, 0);  // stored
    put16(out, 0);  // time
    put16(out, 0);  // date
    put32(out, 0);  // CRC, in the descriptor
    put32(out, 0);  // sizes, in the descriptor
    put32(out, 0);
    put16(out, static_cast<uint16_t>(name.size()));
    put16(out, e.local_extra_len);
    out.append(name);
    const uint16_t z64 = local_zip64_len(e);
    if (z64) {
        put16(out, kZip64ExtraId);
        put16(out, static_cast<uint16_t>(z64 - 4));
        if (big(e.size)) {
            put64(out, e.size);
            put64(out, 0);  // the compressed size is not known when miniz writes the local header
        }
        if (e.big_offset) put64(out, e.header_offset);
    }
    const uint16_t pad = static_cast<uint16_t>(e.local_extra_len - z64 - 4);
    put16(out, kPadExtraId);
    put16(out, pad);
    out.append(pad, 'Z');
}

void append_torch_save_descriptor(std::string& out, const EntryLayout& e, uint32_t crc) {
    if (!e.descriptor_len) return;
    put32(out, kDescriptorSig);
    put32(out, crc);
    if (e.descriptor_len == 24) {
        put64(out, e.size);
        put64(out, e.size);
    } else {
        put32(out, static_cast<uint32_t>(e.size));
        put32(out, static_cast<uint32_t>(e.size));
    }
}

std::string build_torch_save_central_directory(const std::vector<std::string>& names, const ArchiveLayout& L,
                                               const std::vector<uint32_t>& crcs) {
    std::string out;
    out.reserve(L.file_size - L.cd_offset);
    for (std::size_t i = 0; i < names.size(); ++i) {
        const EntryLayout& e = L.entries[i];
        const uint16_t z64 = central_zip64_len(e);
        put32(out, kCentralSig);
        put16(out, 0);  // made by
        put16(out, 0);  // needed
        put16(out, flags(e));
        put16(out, 0);
        put16(out, 0);
        put16(out, 0);
        put32(out, crcs[i]);
        put32(out, clamp32(e.size));
        put32(out, clamp32(e.size));
        put16(out, static_cast<uint16_t>(names[i].size()));
        put16(out, z64);
        put16(out, 0);  // comment
        put16(out, 0);  // disk
        put16(out, 0);  // internal attrs
        put32(out, 0);  // external attrs
        put32(out, clamp32(e.header_offset));
        out.append(names[i]);
        if (z64) {
            put16(out, kZip64ExtraId);
            put16(out, static_cast<uint16_t>(z64 - 4));
            if (big(e.size)) {
                put64(out, e.size);
                put64(out, e.size);
            }
            if (e.big_offset) put64(out, e.header_offset);
        }
    }
    append_end_records(out, names.size(), L.cd_size, L.cd_offset, true, kEndMadeBy, kEndNeeded, false);
    return out;
}

std::string torch_serialization_id(const std::vector<std::string>& records, const std::vector<uint32_t>& crcs) {
    // The names half iterates a default-constructed std::unordered_set filled one insert at a
    // time in write order, as torch's writer fills it: its iteration order (the standard
    // library's bucket order, which depends on the growth steps) is part of the id. A set built
    // from a range is sized up front and iterates differently.
    std::unordered_set<std::string> in_order;
    for (const std::string& r : records) in_order.insert(r);
    uint64_t names_hash = 0;
    for (const std::string& r : in_order) names_hash = hash_combine(names_hash, std::hash<std::string>{}(r));
    uint64_t crc_hash = 0;
    for (uint32_t c : crcs) crc_hash = hash_combine(crc_hash, c);
    char buf[48];
    std::snprintf(buf, sizeof(buf), "%020llu%020llu", static_cast<unsigned long long>(names_hash),
                  static_cast<unsigned long long>(crc_hash));
    return std::string(buf, kSerializationIdSize);
}

}  // namespace pyckpt::zip

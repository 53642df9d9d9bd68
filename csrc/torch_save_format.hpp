// The exact bytes torch.save writes around its records, so that a file pyckpt writes for
// DeepSpeed's save is the file DeepSpeed's own torch.save would have written, byte for byte.
//
// torch.save's ZIP writer (PyTorchStreamWriter over miniz, ZIP64 enabled from the start) differs
// from plan_archive's layout in ways a reader never sees but a byte comparison does:
//   * local headers carry no CRC or sizes (general-purpose flag bit 3) and version 0; a data
//     descriptor (signature, CRC, sizes) follows each member's data: 16 bytes, or 24 with 64-bit
//     sizes whenever the member needs a ZIP64 extra;
//   * a ZIP64 extra is present only for a member whose size or header offset is >= 0xFFFFFFFF:
//     in the local header (size, 0 as the compressed size, then the offset, each only if big),
//     before the "FB" alignment padding; in the central directory (size, size, offset, each only
//     if big), whose 32-bit slots then hold 0xFFFFFFFF;
//   * central headers have version 0 and no attributes; a ZIP64 end record (made by 0x031e,
//     needs 45) and its locator always precede the end record, whose counts and offsets are
//     clamped;
//   * the last member, `.data/serialization_id`, is 40 ASCII digits: a hash of the record names
//     (libstdc++'s std::hash over an unordered_set, in that set's iteration order) and a hash of
//     the records' CRCs in write order, 20 digits each (torch's caffe2/serialize/inline_container.cc,
//     writeSerializationId). Both are computed here with the same standard-library containers
//     torch uses, so a GCC-built pyckpt matches a GCC-built torch.
//
// Thread/GIL contract: pure functions; reentrant, callable from any thread, never touch Python.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zip_format.hpp"

namespace pyckpt::zip {

// The record torch.save writes last; its 40 bytes depend on every other record.
inline constexpr const char* kSerializationIdRecord = ".data/serialization_id";
constexpr std::size_t kSerializationIdSize = 40;

// Where torch.save puts every member. `names` are full member names (archive/record).
ArchiveLayout plan_torch_save(const std::vector<std::string>& names, const std::vector<uint64_t>& sizes);

// The local header of one member (signature through padding).
void append_torch_save_local_header(std::string& out, const std::string& name, const EntryLayout& e);

// The data descriptor that follows a member's data.
void append_torch_save_descriptor(std::string& out, const EntryLayout& e, uint32_t crc);

// Central directory and end records, to be written at layout.cd_offset.
std::string build_torch_save_central_directory(const std::vector<std::string>& names, const ArchiveLayout& layout,
                                               const std::vector<uint32_t>& crcs);

// The 40 digits of `.data/serialization_id` for records named `records` (below the archive's
// folder, without the id record itself) whose CRCs, in write order, are `crcs`: the CRCs of the
// records that have a data descriptor (torch combines them as it writes each descriptor, and an
// empty record gets none).
std::string torch_serialization_id(const std::vector<std::string>& records, const std::vector<uint32_t>& crcs);

}  // namespace pyckpt::zip

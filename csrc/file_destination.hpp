// The files write_archives makes: every output created new (O_EXCL | O_NOFOLLOW, so nothing
// already at its path, a planted symlink above all, is written through) and sized up front, so
// windows land in any order and all-zero windows stay holes. A torch.save ZIP archive (stored
// members, 64-byte aligned records) gets its local headers and central directory, which carry
// the CRCs, once its last window is done; a raw file gets only its inline records. The writing
// half of the ZIP format; the reading half is archive.cpp.
//
// Thread/GIL contract: Destination's (destination.hpp). Nothing here touches Python.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "destination.hpp"
#include "executor.hpp"
#include "ops.hpp"
#include "zip_format.hpp"

namespace pyckpt {

// The references must outlive the destination (they belong to the write_archives call).
std::unique_ptr<Destination> make_file_destination(const std::vector<OutputSpec>& outputs,
                                                   const WriteOptions& options,
                                                   const std::vector<zip::ArchiveLayout>& layouts,
                                                   const std::vector<std::vector<zip::SeriesPart>>& series,
                                                   const std::vector<std::vector<std::string>>& names,
                                                   const std::vector<uint64_t>& output_first_target,
                                                   const WindowPlan& plan);

}  // namespace pyckpt

// The member tables and one small member (data.pkl) of many torch.save archives, read in parallel.
//
// Planning a conversion reads the metadata of every file of a checkpoint: at frontier scale tens
// of thousands (one per ZeRO rank, one per (layer, expert) under AutoEP). Opening, mapping and
// indexing each one costs more than unpickling its small data.pkl, so that part runs here on a
// pool of threads while the caller only parses.
//
// Thread/GIL contract: read_archive_heads runs its work on parallel_for's pool and must be
// called without the GIL; nothing here touches Python. At most `workers` archives are open (one
// descriptor and one mapping each) at any moment, whatever the number of paths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "archive.hpp"

namespace pyckpt {

struct ArchiveHead {
    // False when the archive could not be opened or indexed; the caller opens that one path alone
    // to report why (the error text is not kept: one refusal path, the single-file one).
    bool ok = false;
    uint64_t size = 0;
    std::string prefix;
    std::vector<ArchiveMember> members;
    // The member <prefix>/<member>, when present and at most max_bytes long.
    bool has_member = false;
    std::string member_bytes;
};

// A byte range of a file holding one archive (a torch.distributed.checkpoint chunk).
struct ArchiveWindow {
    uint64_t base = 0;
    uint64_t length = 0;
};

// One head per path, in order. `member` is the name under the archive's top-level folder. With
// `windows` (one per path), each archive is the one in that byte range of its file; member offsets
// stay absolute and `size` is the window's length.
std::vector<ArchiveHead> read_archive_heads(const std::vector<std::string>& paths, const std::string& member,
                                            uint64_t max_bytes, unsigned workers,
                                            const std::vector<ArchiveWindow>* windows = nullptr);

}  // namespace pyckpt

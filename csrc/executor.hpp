// Entry points that run an op table: write_archives() builds new files (torch-loadable ZIP
// archives, or raw files such as safetensors) and execute_into() gathers into a caller buffer.
//
// Thread/GIL contract: call from one thread with the GIL released (nothing here touches
// Python). Work runs on internal worker threads; `progress` is invoked only on the calling
// thread, about every 100 ms and once more at the end, so it may reacquire the GIL. If it
// returns false or throws, the workers stop, outputs created so far are removed, and the call
// throws Cancelled (or progress's exception). The caller must keep `dst` alive and unaliased
// for the duration of execute_into().
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ops.hpp"

namespace pyckpt {

struct RecordSpec {
    std::string name;  // member name below the archive's top folder
    uint64_t size = 0;
    bool has_inline = false;
    std::string inline_bytes;  // used when has_inline
};

// What an output file is made of its records.
enum class Container : uint8_t {
    // A torch.save ZIP archive: stored members `archive_name/record`, 64-byte aligned, with CRCs.
    TorchZip,
    // The records back to back from offset 0, in order, nothing else (a safetensors file is its
    // header as an inline record, then the tensors). archive_name must be empty.
    Raw,
    // Several torch.save ZIP archives back to back, each self-contained (its offsets count from
    // its own first byte, which lies on a 64-byte boundary of the file) and all named
    // archive_name: torch.distributed.checkpoint's data files hold one archive per tensor chunk
    // and load each from its (offset, length) slice. archive_starts says where each begins.
    TorchZipSeries,
    // Byte for byte the file torch.save writes for the same records (torch_save_format.hpp): the
    // records in torch's order, the last one `.data/serialization_id` (40 bytes, inline; its
    // content is computed here once every other record's CRC is known).
    TorchSave,
};

struct OutputSpec {
    std::string path;
    std::string archive_name;
    std::vector<RecordSpec> records;
    Container container = Container::TorchZip;
    // TorchZipSeries only: the index of each archive's first record, ascending from 0; record
    // names are unique within an archive, not across the series.
    std::vector<std::size_t> archive_starts;
};

struct WriteOptions {
    int64_t workers = 0;  // 0: one per CPU
    bool fsync = false;
    bool force_zip64 = false;     // test knob: ZIP64 structures even for small files
    uint64_t window_bytes = 0;    // 0: default (kDefaultWindowBytes)
    std::string root;             // non-empty: every output path must lie strictly below it
    bool copy_in_kernel = true;   // copy_file_range for page-aligned plain runs of raw files (test knob)
    // An existing regular file at an output path (one link, not a symlink) is written over in place
    // and resized instead of refused: its pages are reused, so a file rewritten every save costs no
    // new memory on tmpfs. Every byte of such a file is written (no holes are left to read as zeros).
    bool reuse_outputs = false;
    // WriteStats::file_crcs gets the CRC-32 of every output's whole file, combined from the CRCs
    // the copy computed and those of the framing, without reading the file back.
    bool file_crcs = false;
    // Sources that are memory the caller owns rather than files: (source index, address, length).
    // The caller keeps the memory alive and unchanged until the call returns.
    struct MemorySource {
        std::size_t index;
        const uint8_t* data;
        uint64_t size;
    };
    std::vector<MemorySource> memory_sources;
};

struct WriteStats {
    uint64_t bytes_written = 0;  // total size of the files produced (headers included)
    uint64_t files = 0;
    uint64_t records = 0;
    std::vector<uint32_t> file_crcs;  // per output, with WriteOptions::file_crcs
};

// Windows are the unit of scheduling, CRC and page dropping. 4 MiB keeps per-window costs
// (madvise TLB shootdowns, task hand-off) small while leaving enough windows to balance.
constexpr uint64_t kDefaultWindowBytes = 4u << 20;

// Returns false to cancel. Arguments: bytes done, bytes total.
using ProgressFn = std::function<bool(uint64_t, uint64_t)>;

// Writes every output in one parallel pass. Validation failures throw PlanError before any output is touched (naming the output path and
// record). Outputs are created new (an existing file or symlink at an output path is an
// error). I/O failures throw std::system_error naming the path, and a source that shrank while
// read throws SourceChangedError; every output this call created is then removed.
WriteStats write_archives(const std::vector<std::string>& sources, const std::vector<OutputSpec>& outputs,
                          const OpRow* ops, std::size_t n_ops, const WriteOptions& options,
                          const ProgressFn& progress);

// Same op semantics with one destination buffer: `out` and `rec` must be 0 and dst_off is
// the byte offset in `dst`. No coverage requirement. Returns the bytes written.
uint64_t execute_into(const std::vector<std::string>& sources, const OpRow* ops, std::size_t n_ops,
                      uint8_t* dst, uint64_t dst_len, int64_t workers, uint64_t window_bytes,
                      const ProgressFn& progress);

}  // namespace pyckpt

// Where an executor's bytes go, kept apart from how windows are scheduled and filled
// (executor.cpp), so a new kind of output is one more implementation of this interface.
//
// Thread/GIL contract: offsets are absolute within an output; every method may be called from any
// worker thread, for different windows of the same or different outputs at once, except abandon(),
// which runs after the workers stopped. Nothing here touches Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sources.hpp"

namespace pyckpt {

class Destination {
public:
    virtual ~Destination() = default;
    // Whether finish() needs the CRC-32 of each window of `output` (the runner then computes it
    // while the bytes are cache-hot; otherwise it skips the work).
    virtual bool wants_crc(std::size_t output) const noexcept = 0;
    // Runs before a window of `output` is filled; creating the output lazily here keeps files
    // that are never reached (a failure earlier on) from existing at all.
    virtual void prepare(std::size_t output) = 0;
    // Memory a window may be gathered into in place, or null: then its bytes go to write(), and
    // windows that are one zero-fill run are skipped, which requires unwritten bytes to read as
    // zeros.
    virtual uint8_t* memory(std::size_t output, uint64_t offset, uint64_t len) = 0;
    // Stores `len` bytes at `offset` of `output`. `p` may point into a mapped source, so an
    // EFAULT from the kernel can mean that source shrank; the runner translates it.
    virtual void write(std::size_t output, const uint8_t* p, uint64_t len, uint64_t offset) = 0;
    // Copies `len` bytes of source `src` from `src_off` to `offset` of `output` without them
    // passing through this process (copy_file_range), for windows that are one plain run of a
    // source and need no CRC. Returns how many bytes it copied from the start (0: the kernel or
    // this destination cannot; the caller writes the rest itself).
    virtual uint64_t copy_range(std::size_t output, SourceSet& sources, std::size_t src, uint64_t src_off,
                                uint64_t len, uint64_t offset) = 0;
    // After the last window of `output` (at once if it has none). Returns how many bytes of the
    // output's total lie outside its windows (headers and such), for progress.
    virtual uint64_t finish(std::size_t output, const std::vector<uint32_t>& window_crc) = 0;
    // A window that is one zero-fill run and was skipped: a destination whose unwritten bytes do
    // not read as zeros (a file written over in place) writes them here.
    virtual void zero_fill(std::size_t output, uint64_t offset, uint64_t len) {
        (void)output, (void)offset, (void)len;
    }
    // The CRC-32 of `output`'s whole file once finish() ran, where this destination computed it.
    virtual bool file_crc(std::size_t output, uint32_t& crc) const {
        (void)output, (void)crc;
        return false;
    }
    // After a failure: removes everything this destination created.
    virtual void abandon() noexcept = 0;
};

}  // namespace pyckpt

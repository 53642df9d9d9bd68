// Executes the pieces of one window into memory: copies, zero fills and conversions, plus the
// bookkeeping of which source pages the window consumed.
//
// Thread/GIL contract: gather_window() and SourceDrops are used by one worker at a time on its
// own window and buffer; the shared SourceSet/pieces/plan are only read (SourceSet::map is
// thread-safe). No Python involvement.
#pragma once

#include <cstdint>
#include <vector>

#include "ops.hpp"
#include "sources.hpp"

namespace pyckpt {

// Source byte ranges a window read, merged and released with MappedFile::drop once the
// window's output is safely written (so RSS stays bounded by the windows in flight).
class SourceDrops {
public:
    void add(int64_t src, uint64_t off, uint64_t len);
    void release(SourceSet& sources);  // drops and clears

private:
    struct Range {
        int64_t src;
        uint64_t lo, hi;
    };
    std::vector<Range> ranges_;
};

// Fills out[0, w.end - w.begin) with the window's bytes. Every byte the pieces cover is
// written; bytes no piece covers are left untouched.
void gather_window(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces,
                   SourceSet& sources, uint8_t* out, SourceDrops& drops);

// The window is exactly one plain copy run: returns its source bytes (zero-copy path), else
// nullptr. `src_index`/`src_off` receive the run's source for page dropping.
const uint8_t* window_as_source_run(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces,
                                    SourceSet& sources, int64_t& src_index, uint64_t& src_off);

// The window is exactly one plain copy run from a source: its index and the offset of the
// window's first byte there, nothing mapped.
bool window_source_run(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces,
                       int64_t& src_index, uint64_t& src_off);

// The window is exactly one zero-fill run.
bool window_is_zero_fill(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces);

}  // namespace pyckpt

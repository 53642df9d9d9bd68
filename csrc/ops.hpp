// The op table: parsing and validating rows, proving exact coverage of each record, and
// cutting destinations into windows (the unit of parallel work and of CRC computation).
//
// Thread/GIL contract: everything here runs on one thread before execution starts and
// produces immutable data that workers then read concurrently. No Python involvement.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <string>
#include <vector>

#include "sources.hpp"

namespace pyckpt {

// The op table's column names, in order: the one definition that the binding exports as
// OP_COLUMNS for Python to build tables by and that OpRow's layout is checked against. The last
// column, src_stride, may be left off (a table of kRequiredOpColumns columns): 0 there means the
// rows of an op follow each other in the source.
inline constexpr std::array<std::string_view, 10> kOpColumns = {"src",  "src_off", "out",    "rec",
                                                                "dst_off", "nbytes", "kind", "rows",
                                                                "stride",  "src_stride"};
inline constexpr std::size_t kRequiredOpColumns = 9;

// One row of the caller's int64 (N, 10) table, in column order.
struct OpRow {
    int64_t src, src_off, out, rec, dst_off, nbytes, kind, rows, stride, src_stride;
};
static_assert(sizeof(OpRow) == kOpColumns.size() * sizeof(int64_t), "OpRow must mirror a row of the op table");
static_assert(offsetof(OpRow, stride) == 8 * sizeof(int64_t) && kOpColumns[8] == "stride" &&
                  offsetof(OpRow, src_stride) == 9 * sizeof(int64_t) && kOpColumns[9] == "src_stride" &&
                  offsetof(OpRow, src_off) == 1 * sizeof(int64_t) && kOpColumns[1] == "src_off" &&
                  offsetof(OpRow, dst_off) == 4 * sizeof(int64_t) && kOpColumns[4] == "dst_off",
              "OpRow's fields must follow kOpColumns");

// A validated op. Row i reads src_row bytes at src_off + i*src_stride and produces dst_row bytes
// at dst_off + i*stride within its target.
struct Piece {
    int64_t src;  // source index, -1 for zero fill
    int64_t kind;
    uint64_t src_off;
    uint64_t src_row;
    uint64_t src_stride;  // >= src_row; src_row where the rows follow each other in the source
    uint64_t dst_off;
    uint64_t dst_row;
    uint64_t rows;
    uint64_t stride;
    uint32_t target;
    uint64_t op_index;  // row in the caller's table, for error messages

    uint64_t dst_end() const noexcept { return dst_off + (rows - 1) * stride + dst_row; }
    uint64_t dst_bytes() const noexcept { return rows * dst_row; }
};

// A destination region: one record of an output archive, or the caller's buffer.
struct Target {
    uint64_t base = 0;  // absolute offset (file offset, or buffer offset) of the region start
    uint64_t size = 0;
    bool fillable = true;  // false for records given inline: ops may not touch them
    std::string label;     // names the output path and record in messages
};

// Validates `rows` and turns them into pieces (dropping empty ones, merging rows that are
// contiguous in the destination). `resolve` maps (out, rec) to a target index or throws.
// Errors: PlanError (bad indices, kind, misaligned sizes, ranges outside the source or the
// target); std::system_error if a source cannot be stat'ed or is not a regular file.
template <class Resolve>
std::vector<Piece> parse_ops(const OpRow* rows, std::size_t n, SourceSet& sources,
                             const std::vector<Target>& targets, Resolve&& resolve);

// Requires the pieces of every fillable target to cover it exactly once. Throws
// PlanError naming the target's label and the first gap or overlap.
void check_exact_coverage(const std::vector<Piece>& pieces, const std::vector<Target>& targets);

struct Window {
    uint32_t target;
    uint64_t begin, end;          // target-relative byte range
    uint64_t ref_begin, ref_end;  // pieces touching it: WindowPlan::refs[ref_begin, ref_end)
};

struct WindowPlan {
    std::vector<Window> windows;  // grouped by target, in destination order
    std::vector<uint32_t> refs;   // piece indices
    std::vector<uint64_t> target_first;  // first window of each target (size targets+1)
};

// Cuts every fillable target into windows whose absolute boundaries fall on multiples of
// `window_bytes` (so writes stay page-aligned inside a file) and lists the pieces touching
// each. With `skip_empty`, windows no piece touches are left out (sparse buffers).
WindowPlan plan_windows(const std::vector<Piece>& pieces, const std::vector<Target>& targets,
                        uint64_t window_bytes, bool skip_empty);

// Shared piece validation used by parse_ops (exposed for the template).
Piece make_piece(const OpRow& r, std::size_t index, SourceSet& sources, const std::vector<Target>& targets,
                 uint32_t target);

template <class Resolve>
std::vector<Piece> parse_ops(const OpRow* rows, std::size_t n, SourceSet& sources,
                             const std::vector<Target>& targets, Resolve&& resolve) {
    std::vector<Piece> out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
        uint32_t t = resolve(rows[i], i);
        Piece p = make_piece(rows[i], i, sources, targets, t);
        if (p.rows != 0 && p.dst_row != 0) out.push_back(p);
    }
    return out;
}

}  // namespace pyckpt

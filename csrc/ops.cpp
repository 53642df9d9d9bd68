#include "ops.hpp"

#include <algorithm>
#include <queue>
#include <stdexcept>

#include "dtype_kernels.hpp"
#include "errors.hpp"

namespace pyckpt {

namespace {

std::string row_ctx(std::size_t index) { return "op row " + std::to_string(index); }

bool mul_ok(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }
bool add_ok(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_add_overflow(a, b, &out); }

[[noreturn]] void bad(std::size_t index, const Target& tg, const std::string& what) {
    throw PlanError(row_ctx(index) + " (writing " + tg.label + "): " + what);
}

}  // namespace

Piece make_piece(const OpRow& r, std::size_t index, SourceSet& sources, const std::vector<Target>& targets,
                 uint32_t target) {
    const Target& tg = targets[target];
    if (r.kind < 0 || r.kind >= KIND_COUNT) bad(index, tg, "unknown kind " + std::to_string(r.kind));
    if (r.nbytes < 0) bad(index, tg, "negative nbytes");
    if (r.rows < 0) bad(index, tg, "negative rows");
    if (r.stride < 0) bad(index, tg, "negative stride");
    if (r.src_stride < 0) bad(index, tg, "negative src_stride");
    if (r.dst_off < 0) bad(index, tg, "negative dst_off");
    if (r.src < -1 || (r.src >= 0 && static_cast<uint64_t>(r.src) >= sources.count()))
        throw PlanError(row_ctx(index) + ": source index " + std::to_string(r.src) + " out of range (" +
                                std::to_string(sources.count()) + " sources)");
    if (!tg.fillable) bad(index, tg, "the record has inline bytes, so ops may not write it");

    Piece p{};
    p.src = r.src;
    p.kind = r.kind;
    p.src_off = r.src >= 0 ? static_cast<uint64_t>(r.src_off) : 0;
    p.src_row = static_cast<uint64_t>(r.nbytes);
    p.src_stride = r.src_stride > 0 ? static_cast<uint64_t>(r.src_stride) : p.src_row;
    p.dst_off = static_cast<uint64_t>(r.dst_off);
    p.rows = static_cast<uint64_t>(r.rows);
    p.stride = static_cast<uint64_t>(r.stride);
    p.target = target;
    p.op_index = index;

    const uint32_t in = kind_src_itemsize(r.kind);
    if (p.src_row % in != 0)
        bad(index, tg, "nbytes " + std::to_string(p.src_row) + " is not a multiple of the " + kind_name(r.kind) +
                       " source item size " + std::to_string(in));
    p.dst_row = p.src_row / in * kind_dst_itemsize(r.kind);
    if (p.rows == 0 || p.dst_row == 0) return p;  // no bytes: dropped by the caller

    if (p.rows > 1 && p.stride < p.dst_row)
        bad(index, tg, "stride " + std::to_string(p.stride) + " is smaller than the destination row size " +
                       std::to_string(p.dst_row) + ", so rows overlap");

    if (p.rows > 1 && p.src_stride < p.src_row)
        bad(index, tg, "src_stride " + std::to_string(p.src_stride) + " is smaller than nbytes " +
                       std::to_string(p.src_row) + ", so source rows overlap");

    // The source bytes span from the first row's start to the last row's end.
    uint64_t src_total, src_end;
    if (!mul_ok(p.rows - 1, p.src_stride, src_total) || !add_ok(src_total, p.src_row, src_total))
        bad(index, tg, "(rows - 1) * src_stride + nbytes overflows");
    if (p.src >= 0) {
        if (r.src_off < 0) bad(index, tg, "negative src_off");
        uint64_t sz = sources.size_of(static_cast<std::size_t>(p.src));
        if (!add_ok(p.src_off, src_total, src_end) || src_end > sz)
            bad(index, tg, "source range [" + std::to_string(p.src_off) + ", " + std::to_string(p.src_off + src_total) +
                           ") is outside '" + sources.path(static_cast<std::size_t>(p.src)) + "' (" +
                           std::to_string(sz) + " bytes)");
        sources.require(static_cast<std::size_t>(p.src), src_end);
    }
    uint64_t span, dst_end;
    if (!mul_ok(p.rows - 1, p.stride, span) || !add_ok(span, p.dst_row, span) || !add_ok(p.dst_off, span, dst_end) ||
        dst_end > tg.size)
        bad(index, tg, "destination range [" + std::to_string(p.dst_off) + ", " + std::to_string(p.dst_off + span) +
                       ") is outside " + tg.label + " (" + std::to_string(tg.size) + " bytes)");

    // Rows that are adjacent in the destination and in the source are one contiguous run;
    // merging them lets whole windows take the zero-copy path.
    if (p.rows > 1 && p.stride == p.dst_row && p.src_stride == p.src_row) {
        p.src_row *= p.rows;
        p.dst_row *= p.rows;
        p.rows = 1;
    }
    if (p.rows == 1) {
        p.stride = 0;
        p.src_stride = p.src_row;
    }
    return p;
}

void check_exact_coverage(const std::vector<Piece>& pieces, const std::vector<Target>& targets) {
    std::vector<std::vector<uint32_t>> by_target(targets.size());
    for (std::size_t i = 0; i < pieces.size(); ++i) by_target[pieces[i].target].push_back(static_cast<uint32_t>(i));

    auto fail = [&](uint32_t t, const std::string& what) {
        throw PlanError(targets[t].label + ": " + what);
    };

    for (uint32_t t = 0; t < targets.size(); ++t) {
        if (!targets[t].fillable) continue;
        auto& ids = by_target[t];
        const uint64_t size = targets[t].size;
        // Row streams merged in destination order: every next row must start exactly where
        // coverage ends, otherwise there is a gap (later start) or an overlap (earlier start).
        struct Cursor {
            uint64_t start;
            uint32_t piece;
            uint64_t row;
        };
        auto later = [](const Cursor& a, const Cursor& b) { return a.start > b.start; };
        std::priority_queue<Cursor, std::vector<Cursor>, decltype(later)> heap(later);
        for (uint32_t id : ids) heap.push({pieces[id].dst_off, id, 0});
        uint64_t covered = 0;
        uint32_t last_piece = UINT32_MAX;
        while (!heap.empty()) {
            Cursor c = heap.top();
            heap.pop();
            const Piece& p = pieces[c.piece];
            if (c.start > covered)
                fail(t, "gap: bytes [" + std::to_string(covered) + ", " + std::to_string(c.start) +
                            ") are not covered by any op (before op row " + std::to_string(p.op_index) + ")");
            if (c.start < covered)
                fail(t, "overlap: op row " + std::to_string(p.op_index) + " overlaps " +
                            (last_piece == UINT32_MAX ? std::string("another op")
                                                      : "op row " + std::to_string(pieces[last_piece].op_index)) +
                            " at byte " + std::to_string(c.start));
            covered = c.start + p.dst_row;
            last_piece = c.piece;
            if (c.row + 1 < p.rows) heap.push({c.start + p.stride, c.piece, c.row + 1});
        }
        if (covered != size)
            fail(t, "gap: bytes [" + std::to_string(covered) + ", " + std::to_string(size) + ") are not covered by any op");
    }
}

WindowPlan plan_windows(const std::vector<Piece>& pieces, const std::vector<Target>& targets,
                        uint64_t W, bool skip_empty) {
    // Pass 1: number every window of every fillable target.
    std::vector<uint64_t> first(targets.size() + 1, 0);
    for (std::size_t t = 0; t < targets.size(); ++t) {
        const Target& tg = targets[t];
        uint64_t nwin = 0;
        if (tg.fillable && tg.size > 0) nwin = (tg.base + tg.size - 1) / W - tg.base / W + 1;
        first[t + 1] = first[t] + nwin;
    }
    const uint64_t total = first.back();
    auto win_of = [&](uint32_t t, uint64_t rel) { return first[t] + (targets[t].base + rel) / W - targets[t].base / W; };

    // Pass 2: CSR of pieces per window (a piece is listed in every window its span touches;
    // strided pieces interleave, so spans overlap, but their count per window stays small).
    std::vector<uint64_t> count(total + 1, 0);
    for (const Piece& p : pieces) {
        uint64_t a = win_of(p.target, p.dst_off), b = win_of(p.target, p.dst_end() - 1);
        for (uint64_t w = a; w <= b; ++w) ++count[w];
    }
    std::vector<uint64_t> start(total + 1, 0);
    for (uint64_t w = 0; w < total; ++w) start[w + 1] = start[w] + count[w];
    WindowPlan plan;
    plan.refs.resize(start[total]);
    std::vector<uint64_t> fill(start.begin(), start.end() - 1);
    for (std::size_t i = 0; i < pieces.size(); ++i) {
        const Piece& p = pieces[i];
        uint64_t a = win_of(p.target, p.dst_off), b = win_of(p.target, p.dst_end() - 1);
        for (uint64_t w = a; w <= b; ++w) plan.refs[fill[w]++] = static_cast<uint32_t>(i);
    }

    plan.target_first.assign(targets.size() + 1, 0);
    plan.windows.reserve(skip_empty ? 0 : total);
    for (uint32_t t = 0; t < targets.size(); ++t) {
        plan.target_first[t] = plan.windows.size();
        const Target& tg = targets[t];
        for (uint64_t w = first[t]; w < first[t + 1]; ++w) {
            if (skip_empty && count[w] == 0) continue;
            uint64_t abs_lo = ((tg.base / W) + (w - first[t])) * W;
            uint64_t lo = std::max(abs_lo, tg.base) - tg.base;
            uint64_t hi = std::min(abs_lo + W, tg.base + tg.size) - tg.base;
            plan.windows.push_back(Window{t, lo, hi, start[w], start[w + 1]});
        }
    }
    plan.target_first[targets.size()] = plan.windows.size();
    return plan;
}

}  // namespace pyckpt

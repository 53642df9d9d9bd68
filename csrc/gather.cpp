#include "gather.hpp"

#include <algorithm>
#include <cstring>

#include "dtype_kernels.hpp"

namespace pyckpt {

void SourceDrops::add(int64_t src, uint64_t off, uint64_t len) {
    if (src < 0 || len == 0) return;
    ranges_.push_back({src, off, off + len});
}

void SourceDrops::release(SourceSet& sources) {
    if (ranges_.empty()) return;
    std::sort(ranges_.begin(), ranges_.end(),
              [](const Range& a, const Range& b) { return a.src != b.src ? a.src < b.src : a.lo < b.lo; });
    Range cur = ranges_[0];
    auto flush = [&](const Range& r) { sources.map(static_cast<std::size_t>(r.src)).drop(r.lo, r.hi - r.lo); };
    for (std::size_t i = 1; i < ranges_.size(); ++i) {
        const Range& r = ranges_[i];
        if (r.src == cur.src && r.lo <= cur.hi) {
            cur.hi = std::max(cur.hi, r.hi);
        } else {
            flush(cur);
            cur = r;
        }
    }
    flush(cur);
    ranges_.clear();
}

namespace {

// Rows of `p` whose destination bytes intersect [lo, hi): [i0, i1).
void rows_touching(const Piece& p, uint64_t lo, uint64_t hi, uint64_t& i0, uint64_t& i1) {
    if (p.rows == 1) {
        bool hit = p.dst_off < hi && p.dst_off + p.dst_row > lo;
        i0 = 0;
        i1 = hit ? 1 : 0;
        return;
    }
    // Row i spans [dst_off + i*stride, dst_off + i*stride + dst_row); stride >= dst_row > 0.
    i0 = lo < p.dst_off + p.dst_row ? 0 : (lo - p.dst_off - p.dst_row) / p.stride + 1;
    i1 = hi <= p.dst_off ? 0 : (hi - p.dst_off - 1) / p.stride + 1;
    i1 = std::min(i1, p.rows);
    if (i0 > i1) i0 = i1;
}

}  // namespace

void gather_window(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces,
                   SourceSet& sources, uint8_t* out, SourceDrops& drops) {
    for (uint64_t r = w.ref_begin; r < w.ref_end; ++r) {
        const Piece& p = pieces[plan.refs[r]];
        uint64_t i0, i1;
        rows_touching(p, w.begin, w.end, i0, i1);
        if (i0 >= i1) continue;
        const uint8_t* base = p.src >= 0 ? sources.map(static_cast<std::size_t>(p.src)).data() + p.src_off : nullptr;
        // the source bytes of rows [i0, i1): from row i0's start to row i1 - 1's end
        const uint64_t span_off = p.src_off + i0 * p.src_stride;
        const uint64_t span_len = (i1 - i0 - 1) * p.src_stride + p.src_row;
        if (base) sources.map(static_cast<std::size_t>(p.src)).prefetch(span_off, span_len);
        for (uint64_t i = i0; i < i1; ++i) {
            const uint64_t row_dst = p.dst_off + i * p.stride;
            const uint64_t lo = std::max(row_dst, w.begin);
            const uint64_t hi = std::min(row_dst + p.dst_row, w.end);
            if (lo >= hi) continue;
            uint8_t* o = out + (lo - w.begin);
            if (!base) {
                std::memset(o, 0, hi - lo);
            } else if (p.kind == KIND_COPY) {
                std::memcpy(o, base + i * p.src_stride + (lo - row_dst), hi - lo);
            } else {
                convert_byte_range(p.kind, base + i * p.src_stride, lo - row_dst, hi - row_dst, o);
            }
        }
        if (base) drops.add(p.src, span_off, span_len);
    }
}

bool window_source_run(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces,
                       int64_t& src_index, uint64_t& src_off) {
    if (w.ref_end - w.ref_begin != 1) return false;
    const Piece& p = pieces[plan.refs[w.ref_begin]];
    if (p.src < 0 || p.kind != KIND_COPY || p.rows != 1) return false;
    if (p.dst_off > w.begin || p.dst_off + p.dst_row < w.end) return false;
    src_index = p.src;
    src_off = p.src_off + (w.begin - p.dst_off);
    return true;
}

const uint8_t* window_as_source_run(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces,
                                    SourceSet& sources, int64_t& src_index, uint64_t& src_off) {
    if (!window_source_run(w, plan, pieces, src_index, src_off)) return nullptr;
    return sources.map(static_cast<std::size_t>(src_index)).data() + src_off;
}

bool window_is_zero_fill(const Window& w, const WindowPlan& plan, const std::vector<Piece>& pieces) {
    if (w.ref_end - w.ref_begin != 1) return false;
    const Piece& p = pieces[plan.refs[w.ref_begin]];
    return p.src < 0 && p.rows == 1 && p.dst_off <= w.begin && p.dst_off + p.dst_row >= w.end;
}

}  // namespace pyckpt

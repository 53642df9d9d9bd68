// The executor behind executor.hpp's two entry points. One unit, longer than most: the window
// filling, the workers' scheduling and the cancellation/cleanup path share state that the
// compiler should see whole (the hot loop inlines the fill), and every way out of a call must
// leave no output behind, which one reading of one file can check.
#include "executor.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <unordered_set>

#include "crc32.hpp"
#include "destination.hpp"
#include "errors.hpp"
#include "fd.hpp"
#include "file_destination.hpp"
#include "gather.hpp"
#include "output_maps.hpp"
#include "parallel.hpp"
#include "sources.hpp"
#include "torch_save_format.hpp"
#include "zip_format.hpp"

namespace pyckpt {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "torch.save data is little-endian and is copied verbatim; big-endian hosts need byte swaps");

namespace {

constexpr auto kTickInterval = std::chrono::milliseconds(100);
// Zero-copy writes go out in slices small enough to still be in L2 when pwrite copies them
// right after the CRC pass read them; copies into a destination's memory are checksummed in
// slices of this size right after each is copied.
constexpr uint64_t kDirectSlice = 256u << 10;
// Staging buffer per worker; windows larger than this are gathered in slices.
constexpr uint64_t kStagingBytes = 1u << 20;
// The page size the kernel copies by; offsets congruent modulo it copy whole pages.
constexpr uint64_t kPageBytes = 4096;

// Fills one window into a destination: in place where it offers memory, else zero-copy from a
// source that holds the window verbatim, a hole for all zeros, or gathered through `staging`.
struct WindowRunner {
    SourceSet& sources;
    const std::vector<Target>& targets;
    const std::vector<Piece>& pieces;
    const WindowPlan& plan;
    Destination& dest;

    // Returns the window's CRC-32 (0 if the destination does not want it).
    uint32_t run(uint64_t wi, std::size_t o, uint8_t* staging, uint64_t staging_len, SourceDrops& drops) {
        const Window& w = plan.windows[wi];
        dest.prepare(o);
        const uint64_t len = w.end - w.begin;
        const uint64_t off = targets[w.target].base + w.begin;
        const bool want_crc = dest.wants_crc(o);
        uint32_t crc = 0;
        int64_t src = -1;
        uint64_t src_off = 0;
        if (uint8_t* mem = dest.memory(o, off, len)) {
            // With a CRC, slice by slice: it then reads the bytes just copied from the cache, one
            // pass over memory instead of two.
            const uint64_t slice = want_crc ? kDirectSlice : std::max<uint64_t>(len, 1);
            // One plain run of a file in memory (the memory tier's slots): read by the kernel
            // straight into the destination (SourceSet::held_in_memory says why only there).
            const bool by_read = window_source_run(w, plan, pieces, src, src_off) &&
                                 sources.held_in_memory(static_cast<std::size_t>(src));
            UniqueFd read_fd;
            if (by_read) read_fd = sources.open_verified(static_cast<std::size_t>(src));
            uint64_t at = 0;
            do {
                Window part = w;
                part.begin = w.begin + at;
                part.end = std::min(w.end, part.begin + slice);
                if (by_read)
                    read_exact(read_fd.get(), src_off + at, mem + at, part.end - part.begin,
                               sources.path(static_cast<std::size_t>(src)));
                else
                    gather_window(part, plan, pieces, sources, mem + at, drops);
                if (want_crc) crc = crc32(crc, mem + at, part.end - part.begin);
                at += slice;
            } while (at < len);
        } else if (const uint8_t* run = window_as_source_run(w, plan, pieces, sources, src, src_off)) {
            // In the kernel where no CRC is wanted and source and output pages line up: as fast as
            // cp, no source page mapped here. Where they do not (a safetensors payload starts at its
            // header's length), the kernel copies each page in two misaligned parts, a third slower
            // than a write from the mapping.
            const bool pages_line_up = (src_off % kPageBytes) == (off % kPageBytes);
            const uint64_t copied = want_crc || !pages_line_up
                                        ? 0
                                        : dest.copy_range(o, sources, static_cast<std::size_t>(src), src_off, len, off);
            if (copied < len) sources.map(static_cast<std::size_t>(src)).prefetch(src_off + copied, len - copied);
            for (uint64_t at = copied; at < len; at += kDirectSlice) {
                uint64_t n = std::min(kDirectSlice, len - at);
                if (want_crc) crc = crc32(crc, run + at, n);
                try {
                    dest.write(o, run + at, n, off + at);
                } catch (const std::system_error& e) {
                    // The kernel reads the mapped source itself here; pages past a new end of
                    // file give EFAULT instead of SIGBUS. Our own buffers never fault.
                    if (e.code().value() != EFAULT) throw;
                    throw source_changed_error(sources.path(static_cast<std::size_t>(src)));
                }
            }
            drops.add(src, src_off, len);
        } else if (window_is_zero_fill(w, plan, pieces)) {
            if (want_crc) crc = crc32_zeros(0, len);
            dest.zero_fill(o, off, len);
        } else {
            // Gather/CRC/write slice by slice so the staging bytes are still cache-hot for the
            // CRC and the copy into the page cache.
            for (uint64_t at = 0; at < len; at += staging_len) {
                Window part = w;
                part.begin = w.begin + at;
                part.end = std::min(w.end, part.begin + staging_len);
                const uint64_t n = part.end - part.begin;
                gather_window(part, plan, pieces, sources, staging, drops);
                if (want_crc) crc = crc32(crc, staging, n);
                dest.write(o, staging, n, off + at);
            }
        }
        drops.release(sources);
        return crc;
    }
};

// The caller's buffer of execute_into: windows are gathered straight into it.
class BufferDestination final : public Destination {
public:
    explicit BufferDestination(uint8_t* dst) : dst_(dst) {}
    bool wants_crc(std::size_t) const noexcept override { return false; }
    void prepare(std::size_t) override {}
    uint8_t* memory(std::size_t, uint64_t offset, uint64_t) override { return dst_ + offset; }
    void write(std::size_t, const uint8_t* p, uint64_t len, uint64_t offset) override {
        std::memcpy(dst_ + offset, p, len);
    }
    uint64_t copy_range(std::size_t, SourceSet&, std::size_t, uint64_t, uint64_t, uint64_t) override { return 0; }
    uint64_t finish(std::size_t, const std::vector<uint32_t>&) override { return 0; }
    void abandon() noexcept override {}

private:
    uint8_t* dst_;
};

// Everything a write_archives call shares between its workers: the plan and the scheduling
// state, independent of what kind of file the destination makes.
struct WriteJob {
    SourceSet sources;
    std::vector<Target> targets;
    std::vector<uint64_t> output_first_target;  // size outputs+1
    std::vector<zip::ArchiveLayout> layouts;
    std::vector<std::vector<zip::SeriesPart>> series;  // per output; empty unless a series
    std::vector<std::vector<std::string>> names;  // full member names per output
    std::vector<Piece> pieces;
    WindowPlan plan;
    std::vector<uint32_t> window_crc;
    std::unique_ptr<std::atomic<uint64_t>[]> windows_left;  // per output
    Destination* dest = nullptr;
    std::atomic<uint64_t> done{0};
    uint64_t total = 0;

    explicit WriteJob(const std::vector<std::string>& srcs) : sources(srcs) {}

    void run_window(uint64_t wi, uint8_t* staging, uint64_t staging_len, SourceDrops& drops) {
        const Window& w = plan.windows[wi];
        std::size_t o = output_of_target(w.target);
        WindowRunner runner{sources, targets, pieces, plan, *dest};
        window_crc[wi] = runner.run(wi, o, staging, staging_len, drops);
        done.fetch_add(w.end - w.begin, std::memory_order_relaxed);
        if (windows_left[o].fetch_sub(1, std::memory_order_acq_rel) == 1) finalize(o);
    }

    void finalize(std::size_t o) { done.fetch_add(dest->finish(o, window_crc), std::memory_order_relaxed); }

    std::size_t output_of_target(uint32_t t) const {
        auto it = std::upper_bound(output_first_target.begin(), output_first_target.end(), uint64_t{t});
        return static_cast<std::size_t>(it - output_first_target.begin()) - 1;
    }
};

// Whether `path` names something strictly below `root` without leaving it: no empty, "." or
// ".." component after the root. Lexical on purpose: the caller created root's subfolders and
// open() refuses a symlink as the final component, so no name in the plan can steer a write
// elsewhere.
bool is_beneath(const std::string& root, const std::string& path) {
    std::string_view r(root);
    while (r.size() > 1 && r.back() == '/') r.remove_suffix(1);
    if (path.size() <= r.size() + 1 || path.compare(0, r.size(), r) != 0 || path[r.size()] != '/') return false;
    std::string_view rest = std::string_view(path).substr(r.size() + 1);
    while (true) {
        std::size_t slash = rest.find('/');
        std::string_view comp = rest.substr(0, slash);
        if (comp.empty() || comp == "." || comp == "..") return false;
        if (slash == std::string_view::npos) return true;
        rest.remove_prefix(slash + 1);
    }
}

void validate_outputs(const std::vector<OutputSpec>& outputs, const std::string& root) {
    std::unordered_set<std::string> paths;
    for (const OutputSpec& out : outputs) {
        if (out.path.empty()) throw PlanError("output path must not be empty");
        if (!root.empty() && !is_beneath(root, out.path))
            throw PlanError("output '" + escape_bytes(out.path) + "' is not inside the output root '" +
                            escape_bytes(root) + "'");
        if (!paths.insert(out.path).second)
            throw PlanError("output '" + out.path + "' is listed more than once");
        if (out.container != Container::Raw && out.archive_name.empty())
            throw PlanError("output '" + out.path + "': archive_name must not be empty");
        if (out.container == Container::Raw && !out.archive_name.empty())
            throw PlanError("output '" + out.path + "': a raw file has no archive_name");
        const bool series = out.container == Container::TorchZipSeries;
        if (!series && !out.archive_starts.empty())
            throw PlanError("output '" + out.path + "': only a series of archives has archive starts");
        if (series) {
            const auto& st = out.archive_starts;
            bool ok = out.records.empty() ? st.empty() : !st.empty() && st[0] == 0 && st.back() < out.records.size();
            for (std::size_t i = 1; ok && i < st.size(); ++i) ok = st[i] > st[i - 1];
            if (!ok)
                throw PlanError("output '" + out.path +
                                "': archive starts must ascend from record 0, each archive holding a record");
        }
        if (out.container == Container::TorchSave && out.records.empty())
            throw PlanError("output '" + out.path + "': a torch.save file has at least its serialization id record");
        std::unordered_set<std::string> names;
        std::size_t next_start = 0;
        for (std::size_t i = 0; i < out.records.size(); ++i) {
            const RecordSpec& r = out.records[i];
            if (series && next_start < out.archive_starts.size() && out.archive_starts[next_start] == i) {
                names.clear();  // names are an archive's own
                ++next_start;
            }
            if (r.name.empty()) throw PlanError("output '" + out.path + "': empty record name");
            if (!names.insert(r.name).second)
                throw PlanError("output '" + out.path + "': record '" + r.name + "' is listed more than once");
            if (out.container == Container::TorchSave && i + 1 == out.records.size() &&
                (r.name != zip::kSerializationIdRecord || !r.has_inline || r.size != zip::kSerializationIdSize))
                throw PlanError("output '" + out.path + "': a torch.save file ends with record '" +
                                zip::kSerializationIdRecord + "' (40 inline bytes), not '" + r.name + "'");
            if (r.has_inline && r.inline_bytes.size() != r.size)
                throw PlanError("output '" + out.path + "' record '" + r.name + "': size " +
                                            std::to_string(r.size) + " != length of its inline bytes (" +
                                            std::to_string(r.inline_bytes.size()) + ")");
        }
    }
}

// Refuses to truncate a file we are about to read from.
void check_outputs_are_not_sources(const std::vector<OutputSpec>& outputs, SourceSet& sources) {
    for (const OutputSpec& out : outputs) {
        struct stat st {};
        if (::stat(out.path.c_str(), &st) != 0) continue;
        for (std::size_t s = 0; s < sources.count(); ++s) {
            dev_t dev;
            ino_t ino;
            if (sources.identity(s, dev, ino) && dev == st.st_dev && ino == st.st_ino)
                throw PlanError("output '" + out.path + "' is the same file as source '" + sources.path(s) + "'");
        }
    }
}

uint64_t resolve_window(uint64_t w) { return w == 0 ? kDefaultWindowBytes : w; }

// A raw file's records back to back, in the layout type the archives use (data offsets only).
zip::ArchiveLayout raw_layout(const std::vector<uint64_t>& sizes) {
    zip::ArchiveLayout L;
    L.entries.resize(sizes.size());
    for (std::size_t r = 0; r < sizes.size(); ++r) {
        L.entries[r].data_offset = L.file_size;
        if (sizes[r] > UINT64_MAX / 2 - L.file_size) throw PlanError("raw file larger than 2^63 bytes");
        L.file_size += sizes[r];
    }
    return L;
}

}  // namespace

WriteStats write_archives(const std::vector<std::string>& sources, const std::vector<OutputSpec>& outputs,
                          const OpRow* ops, std::size_t n_ops, const WriteOptions& options,
                          const ProgressFn& progress) {
    const unsigned workers = resolve_workers(options.workers);
    validate_outputs(outputs, options.root);
    if (options.reuse_outputs) output_maps::begin_call();
    if (options.file_crcs)
        for (const OutputSpec& out : outputs)
            if (out.container != Container::TorchSave)
                throw PlanError("output '" + out.path + "': whole-file CRCs are computed for torch.save files only");
    WriteJob job(sources);
    for (const WriteOptions::MemorySource& m : options.memory_sources) {
        if (m.index >= sources.size()) throw PlanError("memory source index " + std::to_string(m.index) + " out of range");
        job.sources.borrow(m.index, m.data, m.size);
    }

    // One target per record, numbered output by output so an output's windows are contiguous.
    job.output_first_target.assign(outputs.size() + 1, 0);
    job.layouts.reserve(outputs.size());
    job.names.resize(outputs.size());
    job.series.resize(outputs.size());
    WriteStats stats;
    for (std::size_t o = 0; o < outputs.size(); ++o) {
        const OutputSpec& out = outputs[o];
        std::vector<uint64_t> sizes;
        for (const RecordSpec& r : out.records) {
            job.names[o].push_back(out.archive_name + "/" + r.name);
            sizes.push_back(r.size);
        }
        if (out.container == Container::TorchZipSeries) {
            zip::ArchiveLayout whole;
            job.series[o] = zip::plan_series(job.names[o], sizes, out.archive_starts, options.force_zip64, whole);
            if (whole.file_size > UINT64_MAX / 2) throw PlanError("output '" + out.path + "' larger than 2^63 bytes");
            job.layouts.push_back(std::move(whole));
        } else {
            job.layouts.push_back(out.container == Container::TorchZip ? zip::plan_archive(job.names[o], sizes, options.force_zip64)
                                  : out.container == Container::TorchSave ? zip::plan_torch_save(job.names[o], sizes)
                                                                          : raw_layout(sizes));
        }
        for (std::size_t r = 0; r < out.records.size(); ++r) {
            Target t;
            t.base = job.layouts[o].entries[r].data_offset;
            t.size = out.records[r].size;
            t.fillable = !out.records[r].has_inline;
            t.label = "output '" + out.path + "' record '" + out.records[r].name + "'";
            job.targets.push_back(std::move(t));
        }
        job.output_first_target[o + 1] = job.targets.size();
        stats.bytes_written += job.layouts[o].file_size;
        stats.records += out.records.size();
    }
    stats.files = outputs.size();
    if (job.targets.size() >= UINT32_MAX) throw PlanError("too many records");

    job.pieces = parse_ops(ops, n_ops, job.sources, job.targets, [&](const OpRow& r, std::size_t i) -> uint32_t {
        if (r.out < 0 || static_cast<uint64_t>(r.out) >= outputs.size())
            throw PlanError("op row " + std::to_string(i) + ": output index " + std::to_string(r.out) +
                                    " out of range (" + std::to_string(outputs.size()) + " outputs)");
        const auto& recs = outputs[static_cast<std::size_t>(r.out)].records;
        if (r.rec < 0 || static_cast<uint64_t>(r.rec) >= recs.size())
            throw PlanError("op row " + std::to_string(i) + ": record index " + std::to_string(r.rec) +
                                    " out of range for output '" + outputs[static_cast<std::size_t>(r.out)].path +
                                    "' (" + std::to_string(recs.size()) + " records)");
        return static_cast<uint32_t>(job.output_first_target[static_cast<std::size_t>(r.out)] +
                                     static_cast<uint64_t>(r.rec));
    });
    check_exact_coverage(job.pieces, job.targets);
    check_outputs_are_not_sources(outputs, job.sources);

    const uint64_t W = resolve_window(options.window_bytes);
    job.plan = plan_windows(job.pieces, job.targets, W, /*skip_empty=*/false);
    job.window_crc.assign(job.plan.windows.size(), 0);
    job.windows_left = std::make_unique<std::atomic<uint64_t>[]>(outputs.size());
    std::unique_ptr<Destination> files =
        make_file_destination(outputs, options, job.layouts, job.series, job.names, job.output_first_target,
                              job.plan);
    Destination& dest = *files;
    job.dest = &dest;
    job.total = stats.bytes_written;

    // Task list: each output's windows in order; an output without windows gets one task that
    // only writes its headers.
    constexpr uint64_t kHeadersOnly = UINT64_MAX;
    struct Task {
        uint32_t output;
        uint64_t window;
    };
    std::vector<Task> tasks;
    tasks.reserve(job.plan.windows.size() + outputs.size());
    // Windows of a group of outputs are dealt round-robin, so workers running side by side write
    // different files: two writers on one ext4 file serialize on its inode lock (and spin on the
    // other core). Groups bound how many output files are open at once.
    constexpr std::size_t kInterleave = 32;
    for (std::size_t g0 = 0; g0 < outputs.size(); g0 += kInterleave) {
        const std::size_t g1 = std::min(outputs.size(), g0 + kInterleave);
        uint64_t longest = 0;
        for (std::size_t o = g0; o < g1; ++o) {
            uint64_t w0 = job.plan.target_first[job.output_first_target[o]];
            uint64_t w1 = job.plan.target_first[job.output_first_target[o + 1]];
            job.windows_left[o].store(w1 - w0);
            if (w0 == w1) tasks.push_back({static_cast<uint32_t>(o), kHeadersOnly});
            longest = std::max(longest, w1 - w0);
        }
        for (uint64_t k = 0; k < longest; ++k) {
            for (std::size_t o = g0; o < g1; ++o) {
                uint64_t w0 = job.plan.target_first[job.output_first_target[o]];
                uint64_t w1 = job.plan.target_first[job.output_first_target[o + 1]];
                if (w0 + k < w1) tasks.push_back({static_cast<uint32_t>(o), w0 + k});
            }
        }
    }

    const uint64_t staging_len = std::min(W, kStagingBytes);
    std::vector<std::unique_ptr<uint8_t[]>> staging(workers);
    std::vector<SourceDrops> drops(workers);
    auto task = [&](uint64_t i, unsigned wid) {
        const Task& tk = tasks[i];
        if (tk.window == kHeadersOnly) {
            job.finalize(tk.output);
            return;
        }
        if (!staging[wid]) staging[wid] = std::make_unique<uint8_t[]>(staging_len);
        job.run_window(tk.window, staging[wid].get(), staging_len, drops[wid]);
    };
    auto tick = [&]() -> bool { return !progress || progress(job.done.load(), job.total); };
    try {
        parallel_for(tasks.size(), workers, task, tick, kTickInterval);
        job.sources.check_unchanged();
        if (progress && !progress(job.total, job.total)) throw Cancelled();
    } catch (...) {
        dest.abandon();
        throw;
    }
    if (options.file_crcs) {
        stats.file_crcs.assign(outputs.size(), 0);
        for (std::size_t o = 0; o < outputs.size(); ++o)
            if (!dest.file_crc(o, stats.file_crcs[o]))
                throw PlanError("output '" + outputs[o].path + "': no whole-file CRC for its container");
    }
    return stats;
}

uint64_t execute_into(const std::vector<std::string>& source_paths, const OpRow* ops, std::size_t n_ops,
                      uint8_t* dst, uint64_t dst_len, int64_t workers_requested, uint64_t window_bytes,
                      const ProgressFn& progress) {
    const unsigned workers = resolve_workers(workers_requested);
    SourceSet sources(source_paths);
    std::vector<Target> targets(1);
    targets[0].base = 0;
    targets[0].size = dst_len;
    targets[0].label = "destination buffer";
    std::vector<Piece> pieces = parse_ops(ops, n_ops, sources, targets, [&](const OpRow& r, std::size_t i) -> uint32_t {
        if (r.out != 0 || r.rec != 0)
            throw PlanError("op row " + std::to_string(i) +
                                        ": execute_into needs out == 0 and rec == 0 (got out=" + std::to_string(r.out) +
                                        ", rec=" + std::to_string(r.rec) + ")");
        return 0;
    });
    uint64_t total = 0;
    for (const Piece& p : pieces) total += p.dst_bytes();
    const uint64_t W = resolve_window(window_bytes);
    WindowPlan plan = plan_windows(pieces, targets, W, /*skip_empty=*/true);

    std::atomic<uint64_t> done{0};
    std::vector<SourceDrops> drops(workers);
    BufferDestination dest(dst);
    WindowRunner runner{sources, targets, pieces, plan, dest};
    auto task = [&](uint64_t i, unsigned wid) {
        const Window& w = plan.windows[i];
        // The buffer offers memory for every window, so no staging is ever needed.
        runner.run(i, 0, nullptr, 0, drops[wid]);
        done.fetch_add(w.end - w.begin, std::memory_order_relaxed);
    };
    // `done` counts window spans, which exceed `total` where pieces leave holes; report the
    // byte total only at the end so values stay monotone and end exactly at total.
    auto tick = [&]() -> bool { return !progress || progress(std::min(done.load(), total), total); };
    parallel_for(plan.windows.size(), workers, task, tick, kTickInterval);
    sources.check_unchanged();
    if (progress && !progress(total, total)) throw Cancelled();
    return total;
}

}  // namespace pyckpt

#include "file_destination.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <mutex>
#include <utility>

#include "crc32.hpp"
#include "errors.hpp"
#include "fault_injection.hpp"
#include "fd.hpp"
#include "fsops.hpp"
#include "output_maps.hpp"
#include "torch_save_format.hpp"

namespace pyckpt {

namespace {

namespace fi = fault_injection;

struct OutputState {
    std::mutex mu;
    UniqueFd fd;
    // fd's number once open, read without the mutex: a window writes in many slices.
    std::atomic<int> open_fd{-1};
    bool created = false;
    bool reused = false;  // an existing file written over in place (WriteOptions::reuse_outputs)
    // Such a file's cached writable mapping (output_maps), held until finish/abandon; windows
    // are copied into it instead of written.
    uint8_t* map = nullptr;
    uint32_t file_crc = 0;
};

// Zeros for zero_fill's writes over a reused file.
constexpr std::size_t kZeroBytes = 1u << 16;
const uint8_t kZeros[kZeroBytes] = {};

// New files: each is created new and sized up front, and windows land at their records' data
// offsets. A torch.save ZIP archive (stored members) gets its headers and central directory,
// which carry the CRCs, once its last window is done; a raw file gets only its inline records.
class FileDestination final : public Destination {
public:
    FileDestination(const std::vector<OutputSpec>& outputs, const WriteOptions& options,
                          const std::vector<zip::ArchiveLayout>& layouts,
                          const std::vector<std::vector<zip::SeriesPart>>& series,
                          const std::vector<std::vector<std::string>>& names,
                          const std::vector<uint64_t>& output_first_target, const WindowPlan& plan)
        : outputs_(outputs),
          options_(options),
          layouts_(layouts),
          series_(series),
          names_(names),
          output_first_target_(output_first_target),
          plan_(plan),
          state_(std::make_unique<OutputState[]>(outputs.size())),
          in_kernel_copy_(options.copy_in_kernel) {}

    bool wants_crc(std::size_t o) const noexcept override { return outputs_[o].container != Container::Raw; }
    void prepare(std::size_t o) override { open_output(o); }
    uint8_t* memory(std::size_t o, uint64_t offset, uint64_t) override {
        uint8_t* map = state_[o].map;  // set under the mutex by prepare(), which ran first on this thread
        return map ? map + offset : nullptr;
    }
    void write(std::size_t o, const uint8_t* p, uint64_t len, uint64_t offset) override {
        int fd = state_[o].open_fd.load(std::memory_order_acquire);
        pwrite_all(fd >= 0 ? fd : open_output(o), p, len, offset, outputs_[o].path);
    }

    uint64_t copy_range(std::size_t o, SourceSet& sources, std::size_t src, uint64_t src_off, uint64_t len,
                        uint64_t offset) override {
        if (!in_kernel_copy_.load(std::memory_order_relaxed) || sources.is_memory(src)) return 0;
        const std::string& path = outputs_[o].path;
        if (int e = fi::next_failure(fi::Call::Write)) throw_errno_code(e, "write", path);
        UniqueFd in = sources.open_verified(src);
        int fd = state_[o].open_fd.load(std::memory_order_acquire);
        if (fd < 0) fd = open_output(o);
        loff_t in_off = static_cast<loff_t>(src_off);
        loff_t out_off = static_cast<loff_t>(offset);
        uint64_t done = 0;
        while (done < len) {
            const std::size_t chunk = static_cast<std::size_t>(std::min<uint64_t>(len - done, 1u << 30));
            ssize_t n = ::copy_file_range(in.get(), &in_off, fd, &out_off, chunk, 0);
            if (n < 0) {
                if (errno == EINTR) continue;
                // Not between these two files (another filesystem, a kernel or filesystem
                // without it): the caller writes through the mapping, as it does from now on.
                if (done == 0 && (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
                    in_kernel_copy_.store(false, std::memory_order_relaxed);
                    return 0;
                }
                throw_errno("write", path);
            }
            // End of file before the validated end: the source shrank under us.
            if (n == 0) throw source_changed_error(sources.path(src));
            done += static_cast<uint64_t>(n);
        }
        return done;
    }

    // Headers can only be written once every window's CRC is known; adjacent header/inline
    // regions are coalesced into single writes.
    uint64_t finish(std::size_t o, const std::vector<uint32_t>& window_crc) override {
        int fd = open_output(o);
        const OutputSpec& out = outputs_[o];
        const zip::ArchiveLayout& L = layouts_[o];
        std::vector<uint32_t> crcs(out.records.size());
        std::string chunk;
        uint64_t chunk_off = 0;
        auto flush = [&] {
            if (!chunk.empty())
                pwrite_all(fd, reinterpret_cast<const uint8_t*>(chunk.data()), chunk.size(), chunk_off, out.path);
            chunk.clear();
        };
        auto place = [&](uint64_t off) {
            if (!chunk.empty() && chunk_off + chunk.size() != off) flush();
            if (chunk.empty()) chunk_off = off;
        };
        if (out.container == Container::Raw) {
            for (std::size_t r = 0; r < out.records.size(); ++r) {
                if (!out.records[r].has_inline) continue;
                place(L.entries[r].data_offset);
                chunk.append(out.records[r].inline_bytes);
            }
        } else {
            for (std::size_t r = 0; r < out.records.size(); ++r) {
                const RecordSpec& rec = out.records[r];
                const uint32_t t = static_cast<uint32_t>(output_first_target_[o] + r);
                uint32_t crc = 0;
                if (rec.has_inline) {
                    crc = crc32(0, rec.inline_bytes.data(), rec.inline_bytes.size());
                } else {
                    for (uint64_t w = plan_.target_first[t]; w < plan_.target_first[t + 1]; ++w)
                        crc = crc32_combine(crc, window_crc[w], plan_.windows[w].end - plan_.windows[w].begin);
                }
                crcs[r] = crc;
            }
            if (out.container == Container::TorchSave) {
                const std::size_t last = out.records.size() - 1;  // the id, validated
                const std::vector<std::string> records = record_names(out, last);
                std::vector<uint32_t> described;
                for (std::size_t r = 0; r < last; ++r)
                    if (L.entries[r].descriptor_len) described.push_back(crcs[r]);
                const std::string id = zip::torch_serialization_id(records, described);
                crcs[last] = crc32(0, id.data(), id.size());
                for (std::size_t r = 0; r < out.records.size(); ++r) {
                    const zip::EntryLayout& e = L.entries[r];
                    place(e.header_offset);
                    zip::append_torch_save_local_header(chunk, names_[o][r], e);
                    if (r == last)
                        chunk.append(id);
                    else if (out.records[r].has_inline)
                        chunk.append(out.records[r].inline_bytes);
                    place(e.data_offset + e.size);
                    zip::append_torch_save_descriptor(chunk, e, crcs[r]);
                }
                place(L.cd_offset);
                const std::string cd = zip::build_torch_save_central_directory(names_[o], L, crcs);
                chunk.append(cd);
                if (options_.file_crcs) state_[o].file_crc = whole_file_crc(o, crcs, id, cd);
            } else if (out.container == Container::TorchZip) {
                for (std::size_t r = 0; r < out.records.size(); ++r) {
                    place(L.entries[r].header_offset);
                    zip::append_local_header(chunk, names_[o][r], L.entries[r], crcs[r]);
                    if (out.records[r].has_inline) chunk.append(out.records[r].inline_bytes);
                }
                place(L.cd_offset);
                chunk.append(zip::build_central_directory(names_[o], L, crcs));
            } else {
                const auto& parts = series_[o];
                for (std::size_t k = 0; k < parts.size(); ++k) {
                    const zip::SeriesPart& part = parts[k];
                    const std::size_t end = k + 1 < parts.size() ? parts[k + 1].first : out.records.size();
                    for (std::size_t r = part.first; r < end; ++r) {
                        place(part.base + part.local.entries[r - part.first].header_offset);
                        zip::append_local_header(chunk, names_[o][r], part.local.entries[r - part.first], crcs[r]);
                        if (out.records[r].has_inline) chunk.append(out.records[r].inline_bytes);
                    }
                    place(part.base + part.local.cd_offset);
                    const std::vector<std::string> part_names(names_[o].begin() + part.first, names_[o].begin() + end);
                    const std::vector<uint32_t> part_crcs(crcs.begin() + part.first, crcs.begin() + end);
                    chunk.append(zip::build_central_directory(part_names, part.local, part_crcs));
                }
            }
        }
        flush();
        if (uint8_t* map = std::exchange(state_[o].map, nullptr)) {
            if (!output_maps::done(map)) throw_errno_code(EIO, "write (the file shrank while it was written)", out.path);
        }
        if (options_.fsync) {
            if (int e = fi::next_failure(fi::Call::Fsync)) throw_errno_code(e, "fsync", out.path);
            if (::fsync(fd) != 0) throw_errno("fsync", out.path);
        }
        {
            std::lock_guard<std::mutex> lk(state_[o].mu);
            int injected = fi::next_failure(fi::Call::Close);
            state_[o].open_fd.store(-1, std::memory_order_release);
            int err = state_[o].fd.close();
            if (injected) throw_errno_code(injected, "close", out.path);
            if (err) throw_errno_code(err, "close", out.path);
        }
        uint64_t window_bytes = 0;
        for (uint64_t w = plan_.target_first[output_first_target_[o]];
             w < plan_.target_first[output_first_target_[o + 1]]; ++w)
            window_bytes += plan_.windows[w].end - plan_.windows[w].begin;
        return L.file_size - window_bytes;
    }

    void zero_fill(std::size_t o, uint64_t offset, uint64_t len) override {
        int fd = open_output(o);
        if (!state_[o].reused) return;  // a new file's unwritten bytes read as zeros already
        for (uint64_t at = 0; at < len; at += kZeroBytes)
            pwrite_all(fd, kZeros, std::min<uint64_t>(kZeroBytes, len - at), offset + at, outputs_[o].path);
    }

    bool file_crc(std::size_t o, uint32_t& crc) const override {
        if (outputs_[o].container != Container::TorchSave) return false;
        crc = state_[o].file_crc;
        return true;
    }

    void abandon() noexcept override {
        for (std::size_t o = 0; o < outputs_.size(); ++o) {
            OutputState& st = state_[o];
            if (uint8_t* map = std::exchange(st.map, nullptr)) output_maps::done(map);
            st.open_fd.store(-1, std::memory_order_relaxed);
            st.fd.reset();
            if (st.created) ::unlink(outputs_[o].path.c_str());
        }
    }

private:
    // The CRC-32 of a torch.save file from its parts in file order: each member's local header,
    // its data (inline bytes, or the CRC its windows gave), its descriptor, then the central
    // directory; any gap between them reads as zeros.
    uint32_t whole_file_crc(std::size_t o, const std::vector<uint32_t>& crcs, const std::string& id,
                            const std::string& cd) const {
        const OutputSpec& out = outputs_[o];
        const zip::ArchiveLayout& L = layouts_[o];
        uint32_t crc = 0;
        uint64_t at = 0;
        auto add = [&](uint64_t offset, uint32_t part, uint64_t len) {
            if (offset > at) crc = crc32_zeros(crc, offset - at);
            crc = crc32_combine(crc, part, len);
            at = offset + len;
        };
        std::string piece;
        const std::size_t last = out.records.size() - 1;
        for (std::size_t r = 0; r < out.records.size(); ++r) {
            const zip::EntryLayout& e = L.entries[r];
            piece.clear();
            zip::append_torch_save_local_header(piece, names_[o][r], e);
            add(e.header_offset, crc32(0, piece.data(), piece.size()), piece.size());
            const std::string* bytes = r == last ? &id : out.records[r].has_inline ? &out.records[r].inline_bytes : nullptr;
            add(e.data_offset, bytes ? crc32(0, bytes->data(), bytes->size()) : crcs[r], e.size);
            piece.clear();
            zip::append_torch_save_descriptor(piece, e, crcs[r]);
            add(e.data_offset + e.size, crc32(0, piece.data(), piece.size()), piece.size());
        }
        add(L.cd_offset, crc32(0, cd.data(), cd.size()), cd.size());
        if (L.file_size > at) crc = crc32_zeros(crc, L.file_size - at);
        return crc;
    }

    static std::vector<std::string> record_names(const OutputSpec& out, std::size_t n) {
        std::vector<std::string> names;
        names.reserve(n);
        for (std::size_t r = 0; r < n; ++r) names.push_back(out.records[r].name);
        return names;
    }

    int open_output(std::size_t o) {
        OutputState& st = state_[o];
        std::lock_guard<std::mutex> lk(st.mu);
        if (st.fd) return st.fd.get();
        const std::string& path = outputs_[o].path;
        // O_EXCL | O_NOFOLLOW: an output is always a new file in a fresh folder, so anything
        // already there (a planted symlink above all) is refused rather than written through.
        // Reusing, an existing file is written over only if it is a regular file with no other
        // name: a link elsewhere would see the new bytes (or be a path out of the folder).
        if (int e = fi::next_failure(fi::Call::Open)) throw_errno_code(e, "open", path);
        UniqueFd fd;
        if (options_.reuse_outputs) {
            // O_RDWR: a shared writable mapping needs a descriptor open for reading too.
            fd = UniqueFd(::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
            if (!fd && errno != ENOENT) throw_errno("open", path);
            if (fd) {
                struct stat sb;
                if (::fstat(fd.get(), &sb) != 0) throw_errno("stat", path);
                if (!S_ISREG(sb.st_mode) || sb.st_nlink != 1)
                    throw_errno_code(EEXIST, "reuse (not a regular file with one link)", path);
                st.reused = true;
            }
        }
        if (!fd) fd = UniqueFd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666));
        if (!fd) throw_errno("open", path);
        st.created = true;
        st.fd = std::move(fd);
        // Sizing the file up front lets windows land in any order and leaves all-zero windows
        // as holes that read back as zeros.
        if (::ftruncate(st.fd.get(), static_cast<off_t>(layouts_[o].file_size)) != 0) throw_errno("truncate", path);
        // A file written over in place again and again (a memory tier's slot): copied into its
        // kept mapping, a plain memcpy into the file's own pages (output_maps.hpp has the
        // figures). Not where the file is fsynced: that path stays the descriptor's.
        if (st.reused && !options_.fsync && layouts_[o].file_size >= output_maps::min_bytes())
            st.map = output_maps::acquire(st.fd.get(), layouts_[o].file_size, path);
        st.open_fd.store(st.fd.get(), std::memory_order_release);
        return st.fd.get();
    }

    const std::vector<OutputSpec>& outputs_;
    const WriteOptions& options_;
    const std::vector<zip::ArchiveLayout>& layouts_;
    const std::vector<std::vector<zip::SeriesPart>>& series_;
    const std::vector<std::vector<std::string>>& names_;
    const std::vector<uint64_t>& output_first_target_;
    const WindowPlan& plan_;
    std::unique_ptr<OutputState[]> state_;
    std::atomic<bool> in_kernel_copy_;
};

}  // namespace

std::unique_ptr<Destination> make_file_destination(const std::vector<OutputSpec>& outputs,
                                                   const WriteOptions& options,
                                                   const std::vector<zip::ArchiveLayout>& layouts,
                                                   const std::vector<std::vector<zip::SeriesPart>>& series,
                                                   const std::vector<std::vector<std::string>>& names,
                                                   const std::vector<uint64_t>& output_first_target,
                                                   const WindowPlan& plan) {
    return std::make_unique<FileDestination>(outputs, options, layouts, series, names, output_first_target, plan);
}

}  // namespace pyckpt

#include "archive_heads.hpp"

#include <chrono>
#include <memory>

#include "parallel.hpp"

namespace pyckpt {

// Files up to this size are read rather than mapped (see Archive's read_limit): every shard and
// expert file of a metadata-sized checkpoint, while a real model's multi-GB shards stay mapped and
// only the pages holding their headers are touched.
constexpr uint64_t kReadWholeLimit = 128u << 10;

std::vector<ArchiveHead> read_archive_heads(const std::vector<std::string>& paths, const std::string& member,
                                            uint64_t max_bytes, unsigned workers,
                                            const std::vector<ArchiveWindow>* windows) {
    std::vector<ArchiveHead> heads(paths.size());
    auto task = [&](uint64_t i, unsigned) {
        ArchiveHead& head = heads[i];
        try {
            // Held by pointer: the member index keeps views into the members' names.
            std::unique_ptr<Archive> opened =
                windows ? std::make_unique<Archive>(paths[i], (*windows)[i].base, (*windows)[i].length, kReadWholeLimit)
                        : std::make_unique<Archive>(paths[i], kReadWholeLimit);
            Archive& ar = *opened;
            head.size = ar.size();
            head.prefix = ar.prefix();
            head.members = ar.members();
            for (const ArchiveMember& m : head.members) {
                if (m.name.size() != head.prefix.size() + 1 + member.size() ||
                    m.name.compare(0, head.prefix.size(), head.prefix) != 0 || m.name[head.prefix.size()] != '/' ||
                    m.name.compare(head.prefix.size() + 1, std::string::npos, member) != 0)
                    continue;
                if (m.size <= max_bytes) {
                    head.member_bytes.assign(reinterpret_cast<const char*>(ar.member_data(m)), m.size);
                    ar.check_unchanged();
                    head.has_member = true;
                }
                break;
            }
            head.ok = true;
        } catch (...) {
            head = ArchiveHead{};  // reported by the caller's single-file open
        }
    };
    parallel_for(paths.size(), workers, task, [] { return true; }, std::chrono::milliseconds(100));
    return heads;
}

}  // namespace pyckpt

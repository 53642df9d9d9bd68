// pyckpt._core.Archive: the read-only view of a torch.save ZIP file.
#include "common.hpp"

#include <memory>

#include "../archive.hpp"
#include "../archive_heads.hpp"
#include "../parallel.hpp"

namespace pyckpt::bindings {

namespace {

// Owns the core archive so close() can release the mapping while Python still holds the object.
class PyArchive {
public:
    PyArchive(const py::object& path, const py::object& offset, const py::object& length) {
        std::string p = fspath(path);
        if (offset.is_none() != length.is_none())
            throw py::value_error("Archive: give both offset and length, or neither");
        if (offset.is_none()) {
            py::gil_scoped_release release;
            archive_ = std::make_unique<Archive>(std::move(p));
            return;
        }
        uint64_t base = offset.cast<uint64_t>(), len = length.cast<uint64_t>();
        py::gil_scoped_release release;
        archive_ = std::make_unique<Archive>(std::move(p), base, len, /*read_limit=*/0);
    }
    const Archive& get() const {
        if (!archive_ || archive_->closed()) throw py::value_error("I/O operation on closed archive");
        return *archive_;
    }
    void close() {
        if (archive_) archive_->close();
    }

private:
    std::unique_ptr<Archive> archive_;
};

}  // namespace

void register_archive(py::module_& m) {
    py::class_<PyArchive>(m, "Archive",
                          "Read-only, memory-mapped view of a torch.save ZIP file (stored members only).")
        .def(py::init<const py::object&, const py::object&, const py::object&>(), py::arg("path"),
             py::arg("offset") = py::none(), py::arg("length") = py::none(),
             "The archive of the whole file, or the one in bytes [offset, offset + length) of it (member offsets "
             "stay absolute).")
        .def_property_readonly("base", [](const PyArchive& a) { return a.get().base(); })
        .def_property_readonly("path", [](const PyArchive& a) { return a.get().path(); })
        .def_property_readonly("size", [](const PyArchive& a) { return a.get().size(); })
        .def_property_readonly("prefix", [](const PyArchive& a) { return a.get().prefix(); })
        .def(
            "members",
            [](const PyArchive& a) {
                py::list out;
                for (const auto& mem : a.get().members())
                    out.append(py::make_tuple(mem.name, mem.data_offset, mem.size, mem.crc32));
                return out;
            },
            "[(name, data_offset, size, crc32)] in central-directory order; data_offset is absolute.")
        .def(
            "read",
            [](const PyArchive& a, const std::string& name) {
                const Archive& ar = a.get();
                const ArchiveMember& mem = ar.member(name);
                py::bytes out(reinterpret_cast<const char*>(ar.member_data(mem)), mem.size);
                ar.check_unchanged();
                return out;
            },
            py::arg("name"), "Copy of one member's bytes (meant for small members such as data.pkl).")
        .def("close", &PyArchive::close)
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](PyArchive& a, py::args) { a.close(); });

    m.def(
        "read_archive_heads",
        [](const py::iterable& paths, const std::string& member, uint64_t max_bytes, int64_t workers,
           const py::object& windows) {
            std::vector<std::string> names;
            for (const auto& p : paths) names.push_back(fspath(p));
            std::vector<ArchiveWindow> spans;
            if (!windows.is_none()) {
                for (const auto& w : windows) {
                    auto pair = w.cast<std::pair<uint64_t, uint64_t>>();
                    spans.push_back(ArchiveWindow{pair.first, pair.second});
                }
                if (spans.size() != names.size())
                    throw py::value_error("read_archive_heads: one window per path");
            }
            std::vector<ArchiveHead> heads;
            if (!names.empty()) {
                unsigned n = resolve_workers(workers);
                py::gil_scoped_release release;
                heads = read_archive_heads(names, member, max_bytes, n, windows.is_none() ? nullptr : &spans);
            }
            py::list out;
            for (const ArchiveHead& h : heads) {
                if (!h.ok) {
                    out.append(py::none());
                    continue;
                }
                py::dict members;
                for (const auto& mem : h.members)
                    members[py::str(mem.name)] = py::make_tuple(mem.data_offset, mem.size, mem.crc32);
                py::object data = h.has_member ? py::object(py::bytes(h.member_bytes)) : py::object(py::none());
                out.append(py::make_tuple(h.size, h.prefix, members, data));
            }
            return out;
        },
        py::arg("paths"), py::arg("member"), py::arg("max_bytes"), py::arg("workers") = 0,
        py::arg("windows") = py::none(),
        "For each path, (size, prefix, {name: (data_offset, size, crc32)}, bytes of <prefix>/<member> or None "
        "when absent or longer than max_bytes), or None where the archive could not be opened or indexed (open "
        "that one with Archive to learn why). Archives are read on `workers` threads (0: one per core), at most "
        "that many open at once, without the GIL. With `windows` ((offset, length) per path), each archive is the one in "
        "that byte range of its file (size is the window's length, offsets stay absolute).");
}

}  // namespace pyckpt::bindings

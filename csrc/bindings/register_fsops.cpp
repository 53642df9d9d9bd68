// Atomic renames used to publish an output folder; the filesystem type of an open file.
#include "common.hpp"

#include "../fsops.hpp"

namespace pyckpt::bindings {

void register_fsops(py::module_& m) {
    m.def(
        "rename_exchange",
        [](const py::object& a, const py::object& b) { rename_exchange(fspath(a), fspath(b)); }, py::arg("a"),
        py::arg("b"), "Atomically swap two paths (renameat2 RENAME_EXCHANGE); OSError(EINVAL/ENOSYS) if unsupported.");
    m.def(
        "rename_noreplace",
        [](const py::object& src, const py::object& dst) { rename_noreplace(fspath(src), fspath(dst)); },
        py::arg("src"), py::arg("dst"),
        "Rename unless dst exists (renameat2 RENAME_NOREPLACE); FileExistsError if it does, OSError(EINVAL/ENOSYS) "
        "if unsupported.");
    m.def("filesystem_type", &filesystem_type, py::arg("fd"),
          "The fstatfs f_type of the filesystem holding open file descriptor fd.");
}

}  // namespace pyckpt::bindings

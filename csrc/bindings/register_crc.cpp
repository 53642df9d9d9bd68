// CRC-32 entry points (zlib-compatible) and the implementation selector.
#include "common.hpp"

#include "../crc32.hpp"

namespace pyckpt::bindings {

void register_crc(py::module_& m) {
    m.def(
        "crc32",
        [](py::object data, uint32_t init) {
            BufferView bv(data, false);
            py::gil_scoped_release release;
            return crc32(init, bv.data(), bv.size());
        },
        py::arg("data"), py::arg("init") = 0, "zlib-compatible CRC-32 of a bytes-like object.");
    m.def(
        "crc32_combine", [](uint32_t a, uint32_t b, uint64_t len_b) { return crc32_combine(a, b, len_b); },
        py::arg("crc1"), py::arg("crc2"), py::arg("len2"));
    m.def("crc32_implementations", &crc32_implementations);
    m.def("crc32_active_implementation", &crc32_active_implementation);
    m.def(
        "crc32_using",
        [](const std::string& impl, py::object data, uint32_t init) {
            BufferView bv(data, false);
            py::gil_scoped_release release;
            return crc32_with(impl, init, bv.data(), bv.size());
        },
        py::arg("impl"), py::arg("data"), py::arg("init") = 0);
}

}  // namespace pyckpt::bindings

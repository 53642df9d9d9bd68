// Pickle inspection that runs before anything is unpickled.
#include "common.hpp"

#include "../pickle_scan.hpp"

namespace pyckpt::bindings {

void register_pickle(py::module_& m) {
    // The allowlist itself lives in the opcode table (pickle_scan.cpp); exported for messages and
    // tests so Python never keeps a second copy.
    py::list allowed;
    for (unsigned c = 0; c < 256; ++c)
        if (torch_load_reads(static_cast<uint8_t>(c))) allowed.append(pickle_opcode_name(static_cast<uint8_t>(c)));
    allowed.attr("sort")();
    m.attr("TORCH_SAVE_OPCODES") = py::tuple(allowed);

    py::class_<PickleScan>(m, "PickleScan",
                           "What one opcode walk over a pickle found (scan_pickle); nothing is unpickled.")
        .def_readonly("stores", &PickleScan::stores, "memo stores (PUT, BINPUT, LONG_BINPUT, MEMOIZE) before STOP")
        .def_readonly("max_index", &PickleScan::max_index, "largest explicit memo index stored, -1 if none")
        .def_readonly("max_index_at", &PickleScan::max_index_at, "byte offset of that store")
        .def_property_readonly(
            "overlong_at", [](const PickleScan& s) { return s.overlong ? int64_t(s.scanned) : int64_t{-1}; },
            "offset of an opcode whose length prefix claims more bytes than follow, -1 if none")
        .def_readonly("disallowed_at", &PickleScan::disallowed_at,
                      "offset of the first opcode outside TORCH_SAVE_OPCODES (or byte that is no opcode), -1 if none")
        .def_property_readonly(
            "disallowed_opcode",
            [](const PickleScan& s) -> py::object {
                const char* name = s.disallowed_at < 0 ? nullptr : pickle_opcode_name(s.disallowed_op);
                return name ? py::object(py::str(name)) : py::object(py::none());
            },
            "pickletools' name of that opcode; None if there is none or the byte is no opcode")
        .def("__repr__", [](const PickleScan& s) {
            const char* name = s.disallowed_at < 0 ? nullptr : pickle_opcode_name(s.disallowed_op);
            return "PickleScan(stores=" + std::to_string(s.stores) + ", max_index=" + std::to_string(s.max_index) +
                   ", max_index_at=" + std::to_string(s.max_index_at) +
                   ", overlong_at=" + std::to_string(s.overlong ? int64_t(s.scanned) : int64_t{-1}) +
                   ", disallowed_at=" + std::to_string(s.disallowed_at) +
                   ", disallowed_opcode=" + (name ? name : "None") + ")";
        });

    m.def(
        "scan_pickle",
        [](py::object data) {
            BufferView bv(data, false);
            PickleScan s;
            {
                py::gil_scoped_release release;
                s = scan_pickle(bv.data(), bv.size());
            }
            return s;
        },
        py::arg("data"),
        "One opcode walk over a pickle, without unpickling it: memo stores and the largest explicit memo index, "
        "a length prefix running past the end, and the first opcode torch's weights-only unpickler refuses.");
}

}  // namespace pyckpt::bindings

// Pickle inspection that runs before anything is unpickled.
#include "common.hpp"

#include "../pickle_scan.hpp"

namespace pyckpt::bindings {

void register_pickle(py::module_& m) {
    m.def(
        "pickle_memo_scan",
        [](py::object data) {
            BufferView bv(data, false);
            PickleMemoScan s;
            {
                py::gil_scoped_release release;
                s = scan_pickle_memo(bv.data(), bv.size());
            }
            return py::make_tuple(s.stores, s.max_index, s.max_index_at, s.overlong ? int64_t(s.scanned) : int64_t{-1});
        },
        py::arg("data"),
        "(memo stores, largest explicit memo index or -1, its byte offset, offset of an argument whose length "
        "prefix runs past the end or -1) of a pickle, without unpickling it.");
}

}  // namespace pyckpt::bindings

// Helpers shared by the binding files: argument conversion, buffer access, and running core
// calls without the GIL while a progress hook reports back on the calling thread.
//
// GIL contract: every helper here is called with the GIL held, except what runs inside
// run_released (without it) and ProgressHook (which reacquires it itself).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../errors.hpp"
#include "../ops.hpp"

namespace pyckpt::bindings {

namespace py = pybind11;

inline std::string fspath(const py::handle& obj) {
    // The C API rather than a cached os.fspath object: a static py::object would be released by
    // C++ static destruction after the interpreter has finalized.
    py::object p = py::reinterpret_steal<py::object>(PyOS_FSPath(obj.ptr()));
    if (!p) throw py::error_already_set();
    if (!py::isinstance<py::str>(p)) throw py::type_error("paths must be str or os.PathLike[str]");
    return p.cast<std::string>();
}

// Read-only contiguous bytes of any buffer-protocol object, released with the view.
struct BufferView {
    Py_buffer view{};
    bool held = false;
    BufferView(const py::handle& obj, bool writable) {
        int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw py::error_already_set();
        held = true;
    }
    ~BufferView() {
        if (held) PyBuffer_Release(&view);
    }
    BufferView(const BufferView&) = delete;
    BufferView& operator=(const BufferView&) = delete;
    uint8_t* data() const { return static_cast<uint8_t*>(view.buf); }
    uint64_t size() const { return static_cast<uint64_t>(view.len); }
};

inline bool op_columns_ok(Py_ssize_t columns) {
    return columns == static_cast<Py_ssize_t>(kOpColumns.size()) || columns == static_cast<Py_ssize_t>(kRequiredOpColumns);
}

// Rows of `columns` int64 fields into OpRows; columns left off are 0.
inline std::vector<OpRow> ops_from_rows(const int64_t* data, Py_ssize_t n, Py_ssize_t columns) {
    std::vector<OpRow> rows(static_cast<std::size_t>(n));
    const auto width = static_cast<std::size_t>(columns);
    if (width == kOpColumns.size()) {
        if (!rows.empty()) std::memcpy(rows.data(), data, rows.size() * sizeof(OpRow));
        return rows;
    }
    for (std::size_t i = 0; i < rows.size(); ++i) std::memcpy(&rows[i], data + i * width, width * sizeof(int64_t));
    return rows;
}

// Copies the op table into OpRow structs so that Python threads mutating the array while
// the GIL is released cannot invalidate what was validated.
// An int64 buffer of shape (N, columns), or an empty one-dimensional one: what pyckpt's planner
// hands over (a memoryview of array('q')), taken without numpy, whose import would cost a short
// export a good share of its wall time. Anything else goes through numpy below.
inline std::optional<std::vector<OpRow>> ops_from_int64_buffer(const py::handle& obj) {
    if (!PyObject_CheckBuffer(obj.ptr())) return std::nullopt;
    Py_buffer view{};
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return std::nullopt;
    }
    std::optional<std::vector<OpRow>> rows;
    std::string fmt = view.format ? view.format : "B";
    if (!fmt.empty() && (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@')) fmt.erase(0, 1);
    const bool int64 = view.itemsize == 8 && (fmt == "q" || fmt == "l");
    if (int64 && view.ndim == 2 && op_columns_ok(view.shape[1])) {
        rows = ops_from_rows(static_cast<const int64_t*>(view.buf), view.shape[0], view.shape[1]);
    } else if (int64 && view.ndim == 1 && view.shape[0] == 0) {
        rows.emplace();
    }
    PyBuffer_Release(&view);
    return rows;
}

inline std::vector<OpRow> convert_ops(const py::handle& obj) {
    if (auto rows = ops_from_int64_buffer(obj)) return std::move(*rows);
    py::array arr = py::array::ensure(obj);
    if (!arr) throw py::type_error("ops must be a numpy array");
    char k = arr.dtype().kind();
    if (k != 'i' && k != 'u') throw py::type_error("ops must be an integer array (int64)");
    if (arr.ndim() != 2 || !op_columns_ok(arr.shape(1))) {
        std::string msg = "ops must have shape (N, " + std::to_string(kOpColumns.size()) + ") or (N, " +
                          std::to_string(kRequiredOpColumns) + "): [";
        for (std::size_t c = 0; c < kOpColumns.size(); ++c) {
            if (c) msg += ", ";
            msg += kOpColumns[c];
        }
        throw py::value_error(msg + "], the last optional");
    }
    auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    if (!a) throw py::error_already_set();
    return ops_from_rows(a.data(), a.shape(0), a.shape(1));
}

inline std::vector<std::string> convert_paths(const py::handle& seq, const char* what) {
    std::vector<std::string> out;
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
        throw py::type_error(std::string(what) + " must be a list of paths");
    for (auto item : seq.cast<py::sequence>()) out.push_back(fspath(item));
    return out;
}

inline int64_t convert_workers(const py::object& w) { return w.is_none() ? 0 : w.cast<int64_t>(); }

// Progress hook run on the calling thread: reacquires the GIL, lets pending signals
// (Ctrl-C) surface even without a callback, and parks any Python exception for rethrow.
struct ProgressHook {
    py::object callback;
    std::optional<py::error_already_set> error;

    bool operator()(uint64_t done, uint64_t total) {
        py::gil_scoped_acquire gil;
        try {
            if (PyErr_CheckSignals() != 0) throw py::error_already_set();
            if (!callback.is_none()) callback(done, total);
            return true;
        } catch (py::error_already_set& e) {
            error.emplace(std::move(e));
            return false;
        }
    }
};

// Runs `fn` without the GIL; a Cancelled from the core becomes the parked Python exception.
template <class Fn>
auto run_released(ProgressHook& hook, Fn&& fn) {
    try {
        py::gil_scoped_release release;
        return fn();
    } catch (const Cancelled&) {
        if (hook.error) throw std::move(*hook.error);
        throw std::runtime_error("operation cancelled");
    }
}

// One per concern, each in its register_<concern>.cpp; module.cpp calls them all (register_testing only in
// the test build: CMakeLists.txt, PYCKPT_TESTING).
void register_archive(py::module_& m);
void register_crc(py::module_& m);
void register_pickle(py::module_& m);
void register_executor(py::module_& m);
void register_fsops(py::module_& m);
void register_testing(py::module_& m);

}  // namespace pyckpt::bindings

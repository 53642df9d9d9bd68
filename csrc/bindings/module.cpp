// pyckpt._core: converts Python arguments, releases the GIL around the C++ core, and maps C++
// exceptions to Python ones. No logic beyond that lives here.
//
// GIL contract: every entry point is called with the GIL held; arguments are converted (and
// inline bytes copied) before the GIL is released, so other Python threads may run while
// the core works. The only Python calls made during execution happen on this thread from
// the progress hook, which reacquires the GIL first.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <system_error>

#include "../archive.hpp"
#include "../convert.hpp"
#include "../crc32.hpp"
#include "../errors.hpp"
#include "../executor.hpp"
#include "../fault_injection.hpp"
#include "../fsops.hpp"
#include "../pickle_scan.hpp"

namespace py = pybind11;
using namespace pyckpt;

namespace {

std::string fspath(const py::handle& obj) {
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

// Copies the op table into OpRow structs so that Python threads mutating the array while
// the GIL is released cannot invalidate what was validated.
std::vector<OpRow> convert_ops(const py::handle& obj) {
    py::array arr = py::array::ensure(obj);
    if (!arr) throw py::type_error("ops must be a numpy array");
    char k = arr.dtype().kind();
    if (k != 'i' && k != 'u') throw py::type_error("ops must be an integer array (int64)");
    if (arr.ndim() != 2 || arr.shape(1) != 9)
        throw py::value_error("ops must have shape (N, 9): [src, src_off, out, rec, dst_off, nbytes, kind, rows, stride]");
    auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    if (!a) throw py::error_already_set();
    std::vector<OpRow> rows(static_cast<std::size_t>(a.shape(0)));
    if (!rows.empty()) std::memcpy(rows.data(), a.data(), rows.size() * sizeof(OpRow));
    return rows;
}

std::vector<std::string> convert_paths(const py::handle& seq, const char* what) {
    std::vector<std::string> out;
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
        throw py::type_error(std::string(what) + " must be a list of paths");
    for (auto item : seq.cast<py::sequence>()) out.push_back(fspath(item));
    return out;
}

std::vector<OutputSpec> convert_outputs(const py::handle& seq) {
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
        throw py::type_error("outputs must be a list of (path, archive_name, records) tuples");
    std::vector<OutputSpec> outs;
    for (auto item : seq.cast<py::sequence>()) {
        auto t = item.cast<py::sequence>();
        if (t.size() != 3) throw py::value_error("each output must be (path, archive_name, records)");
        OutputSpec o;
        o.path = fspath(t[0]);
        o.archive_name = t[1].cast<std::string>();
        for (auto r : t[2].cast<py::sequence>()) {
            auto rt = r.cast<py::sequence>();
            if (rt.size() != 3) throw py::value_error("each record must be (name, size, bytes_or_None)");
            RecordSpec rec;
            rec.name = rt[0].cast<std::string>();
            int64_t size = rt[1].cast<int64_t>();
            if (size < 0) throw py::value_error("record '" + rec.name + "' has a negative size");
            rec.size = static_cast<uint64_t>(size);
            py::object data = rt[2];
            if (!data.is_none()) {
                BufferView bv(data, false);
                rec.has_inline = true;
                rec.inline_bytes.assign(reinterpret_cast<const char*>(bv.data()), bv.size());
            }
            o.records.push_back(std::move(rec));
        }
        outs.push_back(std::move(o));
    }
    return outs;
}

int64_t convert_workers(const py::object& w) { return w.is_none() ? 0 : w.cast<int64_t>(); }

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

class PyArchive {
public:
    explicit PyArchive(const py::object& path) {
        std::string p = fspath(path);
        py::gil_scoped_release release;
        archive_ = std::make_unique<Archive>(std::move(p));
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

PYBIND11_MODULE(_core, m) {
    m.doc() = "Native core of pyckpt: torch.save ZIP reading/writing and parallel byte gathering.";

    py::register_exception<ArchiveError>(m, "ArchiveError", PyExc_ValueError);
    py::register_exception<PlanError>(m, "PlanError", PyExc_ValueError);
    py::register_exception<SourceChangedError>(m, "SourceChangedError", PyExc_OSError);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const MemberNotFound& e) {
            py::set_error(PyExc_KeyError, e.what());
        } catch (const std::system_error& e) {
            // OSError(errno, text) picks the matching subclass (FileNotFoundError, ...).
            py::object err = py::reinterpret_steal<py::object>(
                PyObject_CallFunction(PyExc_OSError, "is", e.code().value(), e.what()));
            if (!err) return;  // the constructor failure is already set
            PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
        }
    });

    for (int64_t k = 0; k < KIND_COUNT; ++k) {
        static const char* const names[] = {"KIND_COPY",        "KIND_BF16_TO_F32", "KIND_F16_TO_F32",
                                            "KIND_F64_TO_F32",  "KIND_I64_TO_F32",  "KIND_I32_TO_F32",
                                            "KIND_I16_TO_F32",  "KIND_I8_TO_F32",   "KIND_U8_TO_F32",
                                            "KIND_BOOL_TO_F32"};
        m.attr(names[k]) = k;
    }
    m.attr("DEFAULT_WINDOW_BYTES") = kDefaultWindowBytes;

    py::class_<PyArchive>(m, "Archive",
                          "Read-only, memory-mapped view of a torch.save ZIP file (stored members only).")
        .def(py::init<const py::object&>(), py::arg("path"))
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

    m.def(
        "_f16_to_f32_portable",
        [](py::object data) {
            BufferView bv(data, false);
            if (bv.size() % 2) throw py::value_error("fp16 data must have an even number of bytes");
            std::string out(bv.size() * 2, '\0');
            half_to_f32_portable(bv.data(), reinterpret_cast<uint8_t*>(out.data()), bv.size() / 2);
            return py::bytes(out);
        },
        py::arg("data"), "Test hook: fp16 -> fp32 through the portable (non-F16C) code path.");

    m.def(
        "write_archives",
        [](const py::object& sources, const py::object& outputs, const py::object& ops, const py::object& workers,
           bool fsync, const py::object& progress, bool force_zip64, uint64_t window_bytes, const py::object& root) {
            auto src = convert_paths(sources, "sources");
            auto outs = convert_outputs(outputs);
            auto rows = convert_ops(ops);
            WriteOptions opt;
            opt.workers = convert_workers(workers);
            opt.fsync = fsync;
            opt.force_zip64 = force_zip64;
            opt.window_bytes = window_bytes;
            if (!root.is_none()) opt.root = fspath(root);
            ProgressHook hook{progress, std::nullopt};
            WriteStats st = run_released(hook, [&] {
                return write_archives(src, outs, rows.data(), rows.size(), opt, std::ref(hook));
            });
            py::dict d;
            d["bytes_written"] = st.bytes_written;
            d["files"] = st.files;
            d["records"] = st.records;
            return d;
        },
        py::arg("sources"), py::arg("outputs"), py::arg("ops"), py::arg("workers") = 0, py::arg("fsync") = false,
        py::arg("progress") = py::none(), py::kw_only(), py::arg("force_zip64") = false,
        py::arg("window_bytes") = 0, py::arg("root") = py::none(),
        "Write torch-loadable ZIP archives whose op-filled records are gathered from `sources`. Outputs are "
        "created new (O_EXCL|O_NOFOLLOW); with `root`, every output path must lie strictly below it. Raises "
        "PlanError for a bad table, OSError naming the file for I/O errors, SourceChangedError if a source shrank "
        "while read; outputs created by a failed call are removed.");

    m.def(
        "execute_into",
        [](const py::object& sources, const py::object& ops, const py::object& dst, const py::object& workers,
           const py::object& progress, uint64_t window_bytes) {
            auto src = convert_paths(sources, "sources");
            auto rows = convert_ops(ops);
            BufferView out(dst, true);
            const int64_t n_workers = convert_workers(workers);  // a Python call: before the GIL is released
            ProgressHook hook{progress, std::nullopt};
            return run_released(hook, [&] {
                return execute_into(src, rows.data(), rows.size(), out.data(), out.size(), n_workers, window_bytes,
                                    std::ref(hook));
            });
        },
        py::arg("sources"), py::arg("ops"), py::arg("dst"), py::arg("workers") = 0, py::arg("progress") = py::none(),
        py::kw_only(), py::arg("window_bytes") = 0,
        "Gather op pieces into one writable contiguous buffer; returns the bytes written.");

    m.def(
        "_inject_fault",
        [](const std::string& call, int err, uint64_t after) {
            fault_injection::Call c;
            if (!fault_injection::parse_call(call, c))
                throw py::value_error("call must be one of open, write, fsync, close (got '" + call + "')");
            if (err <= 0) throw py::value_error("errno must be positive");
            fault_injection::arm(c, err, after);
        },
        py::arg("call"), py::arg("errno"), py::arg("after") = 0,
        "Test hook: the (after+1)-th next output `call` (open/write/fsync/close) of the executor fails with errno, "
        "once.");
    m.def("_clear_faults", &fault_injection::disarm, "Test hook: disarms every _inject_fault.");

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
}

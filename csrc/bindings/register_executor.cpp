// The executor entry points (write_archives, execute_into) and the op-table constants.
#include "common.hpp"

#include "../dtype_kernels.hpp"
#include "../executor.hpp"
#include "../output_maps.hpp"
#include "../torch_save_format.hpp"
#include "../zip_format.hpp"

namespace pyckpt::bindings {

namespace {

std::vector<OutputSpec> convert_outputs(const py::handle& seq) {
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
        throw py::type_error("outputs must be a list of (path, archive_name or None, records) tuples");
    std::vector<OutputSpec> outs;
    for (auto item : seq.cast<py::sequence>()) {
        auto t = item.cast<py::sequence>();
        if (t.size() != 3 && t.size() != 4)
            throw py::value_error("each output must be (path, archive_name, records[, archive_starts])");
        OutputSpec o;
        o.path = fspath(t[0]);
        if (t[1].is_none())
            o.container = Container::Raw;  // records back to back (safetensors: header, then tensors)
        else
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
        if (t.size() == 4 && py::isinstance<py::str>(t[3])) {
            if (t[3].cast<std::string>() != "torch_save")
                throw py::value_error("an output's fourth item is archive starts or the string 'torch_save'");
            if (o.container == Container::Raw) throw py::value_error("a raw file is not a torch.save file");
            o.container = Container::TorchSave;
        } else if (t.size() == 4) {
            // a series of archives, one per chunk (torch.distributed.checkpoint's data files)
            if (o.container == Container::Raw) throw py::value_error("a raw file is not a series of archives");
            o.container = Container::TorchZipSeries;
            for (auto start : t[3].cast<py::sequence>()) {
                int64_t v = start.cast<int64_t>();
                if (v < 0) throw py::value_error("archive starts must not be negative");
                o.archive_starts.push_back(static_cast<std::size_t>(v));
            }
        }
        outs.push_back(std::move(o));
    }
    return outs;
}

// Sources as paths, or buffer-protocol objects (memory sources, held until `views` goes).
std::vector<std::string> convert_sources(const py::handle& seq, std::vector<std::unique_ptr<BufferView>>& views,
                                         std::vector<WriteOptions::MemorySource>& memory) {
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
        throw py::type_error("sources must be a list of paths or buffers");
    std::vector<std::string> out;
    for (auto item : seq.cast<py::sequence>()) {
        if (py::isinstance<py::str>(item) || py::hasattr(item, "__fspath__")) {
            out.push_back(fspath(item));
            continue;
        }
        if (!PyObject_CheckBuffer(item.ptr()))
            throw py::type_error("each source must be a path or a buffer (bytes-like memory)");
        views.push_back(std::make_unique<BufferView>(item, false));
        memory.push_back({out.size(), views.back()->data(), views.back()->size()});
        out.push_back("<memory source " + std::to_string(out.size()) + ">");
    }
    return out;
}

// Full member names (ARCHIVE_NAME/name) and sizes of RECORDS, a sequence of (name, size).
void member_records(const std::string& archive_name, const py::object& records, std::vector<std::string>& names,
                    std::vector<uint64_t>& sizes) {
    for (auto r : records.cast<py::sequence>()) {
        auto rt = r.cast<py::sequence>();
        if (rt.size() != 2) throw py::value_error("each record must be (name, size)");
        int64_t size = rt[1].cast<int64_t>();
        if (size < 0) throw py::value_error("record sizes must not be negative");
        names.push_back(archive_name + "/" + rt[0].cast<std::string>());
        sizes.push_back(static_cast<uint64_t>(size));
    }
}

}  // namespace

void register_executor(py::module_& m) {
    static const char* const kind_names[] = {
        "KIND_COPY",       "KIND_BF16_TO_F32", "KIND_F16_TO_F32",  "KIND_F64_TO_F32",  "KIND_I64_TO_F32",
        "KIND_I32_TO_F32", "KIND_I16_TO_F32",  "KIND_I8_TO_F32",   "KIND_U8_TO_F32",   "KIND_BOOL_TO_F32",
        "KIND_F32_TO_BF16", "KIND_F32_TO_F16", "KIND_BF16_TO_F16", "KIND_F16_TO_BF16", "KIND_F64_TO_BF16",
        "KIND_F64_TO_F16"};
    static_assert(sizeof(kind_names) / sizeof(kind_names[0]) == KIND_COUNT, "one Python name per kind");
    for (int64_t k = 0; k < KIND_COUNT; ++k) m.attr(kind_names[k]) = k;
    m.attr("DEFAULT_WINDOW_BYTES") = kDefaultWindowBytes;
    py::tuple columns(kOpColumns.size());
    for (std::size_t c = 0; c < kOpColumns.size(); ++c) columns[c] = py::str(kOpColumns[c].data(), kOpColumns[c].size());
    m.attr("OP_COLUMNS") = columns;

    m.def(
        "write_archives",
        [](const py::object& sources, const py::object& outputs, const py::object& ops, const py::object& workers,
           bool fsync, const py::object& progress, bool force_zip64, uint64_t window_bytes, const py::object& root,
           bool copy_in_kernel, bool reuse_outputs, bool file_crcs) {
            std::vector<std::unique_ptr<BufferView>> views;  // released with the GIL held, after the run
            WriteOptions opt;
            auto src = convert_sources(sources, views, opt.memory_sources);
            auto outs = convert_outputs(outputs);
            auto rows = convert_ops(ops);
            opt.workers = convert_workers(workers);
            opt.fsync = fsync;
            opt.force_zip64 = force_zip64;
            opt.window_bytes = window_bytes;
            opt.copy_in_kernel = copy_in_kernel;
            opt.reuse_outputs = reuse_outputs;
            opt.file_crcs = file_crcs;
            if (!root.is_none()) opt.root = fspath(root);
            ProgressHook hook{progress, std::nullopt};
            WriteStats st = run_released(hook, [&] {
                return write_archives(src, outs, rows.data(), rows.size(), opt, std::ref(hook));
            });
            py::dict d;
            d["bytes_written"] = st.bytes_written;
            d["files"] = st.files;
            d["records"] = st.records;
            if (file_crcs) d["file_crcs"] = st.file_crcs;
            return d;
        },
        py::arg("sources"), py::arg("outputs"), py::arg("ops"), py::arg("workers") = 0, py::arg("fsync") = false,
        py::arg("progress") = py::none(), py::kw_only(), py::arg("force_zip64") = false,
        py::arg("window_bytes") = 0, py::arg("root") = py::none(), py::arg("copy_in_kernel") = true,
        py::arg("reuse_outputs") = false, py::arg("file_crcs") = false,
        "Write new files whose op-filled records are gathered from `sources` (paths, or buffers the caller keeps "
        "unchanged during the call): a torch-loadable ZIP archive per output with an archive_name, the exact file "
        "torch.save writes where an output's fourth item is 'torch_save' (its last record .data/serialization_id, "
        "40 inline bytes computed here), a raw file (its records back to back) per output whose archive_name is None, "
        "several archives back to back where an output has a fourth item (the record index each archive starts at). Outputs are "
        "created new (O_EXCL|O_NOFOLLOW); with `root`, every output path must lie strictly below it. Plain runs of "
        "a source into a raw file whose offsets lie at the same place within a page are copied in the kernel "
        "(copy_file_range) unless copy_in_kernel is False. Raises "
        "PlanError for a bad table, OSError naming the file for I/O errors, SourceChangedError if a source shrank "
        "while read; outputs created by a failed call are removed. reuse_outputs: an existing regular file with one link "
        "at an output path is written over in place (its pages reused) instead of refused. file_crcs: the result's "
        "'file_crcs' lists each torch.save output's whole-file CRC-32, computed without reading the file back. A "
        "reused file of 1 MiB or more (not fsynced) is copied into through a writable mapping kept for later calls "
        "(released by release_output_maps, or at the next call once the file is removed).");

    m.def("release_output_maps", [] { pyckpt::output_maps::release_all(); },
          "Unmap the writable mappings write_archives(reuse_outputs=True) keeps of files it wrote over in place "
          "(the memory of removed files is returned at once instead of at the next such call).");
    m.def(
        "prepare_output_map",
        [](int dir_fd, const std::string& name, uint64_t size, const std::string& path, bool map) {
            py::gil_scoped_release release;
            pyckpt::output_maps::prepare(dir_fd, name, size, path, map);
        },
        py::arg("dir_fd"), py::arg("name"), py::arg("size"), py::arg("path"), py::arg("map") = true,
        "Create the new file NAME in the open folder DIR_FD (no link followed, never an existing entry) with SIZE "
        "bytes allocated now (written as zeros) and, with MAP and from the mapping threshold up, a writable mapping kept "
        "as write_archives keeps one (map only the files this process will write): a later "
        "write_archives(reuse_outputs=True) over this file copies into pages already allocated and mapped. PATH "
        "names the file in errors. The GIL is released.");
    m.def(
        "map_output",
        [](int dir_fd, const std::string& name, uint64_t size, const std::string& path) {
            py::gil_scoped_release release;
            return pyckpt::output_maps::map_existing(dir_fd, name, size, path);
        },
        py::arg("dir_fd"), py::arg("name"), py::arg("size"), py::arg("path"),
        "Map the existing regular file NAME of the open folder DIR_FD (no link followed) of exactly SIZE bytes, "
        "writable, and keep the mapping as write_archives keeps one: a later write_archives(reuse_outputs=True) "
        "over this file then needs no page-table set-up. False (nothing mapped) where the entry is absent, a "
        "link, not a regular file, of another size or below the mapping threshold. PATH names the file in "
        "errors. The GIL is released.");
    m.def("output_maps_info", [] {
              py::dict d;
              d["count"] = pyckpt::output_maps::count();
              d["bytes"] = pyckpt::output_maps::mapped_bytes();
              return d;
          },
          "{'count', 'bytes'} of the writable mappings write_archives keeps of files written over in place.");

    m.def(
        "series_layout",
        [](const std::string& archive_name, const py::object& records, const py::object& starts) {
            std::vector<std::string> names;
            std::vector<uint64_t> sizes;
            member_records(archive_name, records, names, sizes);
            std::vector<std::size_t> st;
            for (auto v : starts.cast<py::sequence>()) {
                int64_t i = v.cast<int64_t>();
                if (i < 0) throw py::value_error("archive starts must not be negative");
                st.push_back(static_cast<std::size_t>(i));
            }
            zip::ArchiveLayout whole;
            std::vector<zip::SeriesPart> parts;
            try {
                parts = zip::plan_series(names, sizes, st, false, whole);
            } catch (const std::invalid_argument& e) {
                throw py::value_error(e.what());
            }
            py::list out;
            for (const zip::SeriesPart& p : parts) out.append(py::make_tuple(p.base, p.local.file_size));
            return out;
        },
        py::arg("archive_name"), py::arg("records"), py::arg("starts"),
        "(offset, length) of each archive of a series as write_archives lays it out: records (name, size) in "
        "order, `starts` the index of each archive's first record.");
    m.def(
        "torch_save_size",
        [](const std::string& archive_name, const py::object& records) {
            std::vector<std::string> names;
            std::vector<uint64_t> sizes;
            member_records(archive_name, records, names, sizes);
            try {
                return zip::plan_torch_save(names, sizes).file_size;
            } catch (const std::invalid_argument& e) {
                throw py::value_error(e.what());
            }
        },
        py::arg("archive_name"), py::arg("records"),
        "The size of the file torch.save writes for records (name, size) in write order, the closing ones "
        "included (.data/serialization_id last): the file write_archives writes for an output whose fourth "
        "item is 'torch_save'.");

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
}

}  // namespace pyckpt::bindings

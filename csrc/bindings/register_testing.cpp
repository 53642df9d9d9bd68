// Test hooks: fault injection for the executor's output syscalls and the portable fp16 paths, in the
// submodule pyckpt._core.testing, which nothing in the package imports. Compiled only in the test build
// (CMake option PYCKPT_TESTING: scripts/setup.sh for the tests, scripts/sanitize.sh); a release build has
// no such submodule. The core's side (fault_injection.cpp, consulted by file_destination.cpp) is in every
// build: disarmed, it costs one relaxed atomic load per output syscall, and without this file nothing can
// arm it.
#include "common.hpp"

#include "../dtype_kernels.hpp"
#include "../fault_injection.hpp"
#include "../fd.hpp"
#include "../output_maps.hpp"

#include <fcntl.h>
#include <unistd.h>

namespace pyckpt::bindings {

void register_testing(py::module_& core) {
    py::module_ m = core.def_submodule(
        "testing", "Test hooks (fault injection, portable kernels); not part of pyckpt's interface.");
    m.def(
        "f16_to_f32_portable",
        [](py::object data) {
            BufferView bv(data, false);
            if (bv.size() % 2) throw py::value_error("fp16 data must have an even number of bytes");
            std::string out(bv.size() * 2, '\0');
            half_to_f32_portable(bv.data(), reinterpret_cast<uint8_t*>(out.data()), bv.size() / 2);
            return py::bytes(out);
        },
        py::arg("data"), "Test hook: fp16 -> fp32 through the portable (non-F16C) code path.");
    m.def(
        "f32_to_f16_portable",
        [](py::object data) {
            BufferView bv(data, false);
            if (bv.size() % 4) throw py::value_error("fp32 data must have a multiple of 4 bytes");
            std::string out(bv.size() / 2, '\0');
            f32_to_half_portable(bv.data(), reinterpret_cast<uint8_t*>(out.data()), bv.size() / 4);
            return py::bytes(out);
        },
        py::arg("data"), "Test hook: fp32 -> fp16 through the portable (non-F16C) code path.");

    m.def(
        "inject_fault",
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
    m.def("clear_faults", &fault_injection::disarm, "Test hook: disarms every inject_fault.");
    m.def(
        "write_past_a_shrunk_output_map",
        [](const std::string& path) {
            // What another process truncating a memory-tier file under a save does to the writer: the
            // file's kept mapping written past its new end.
            UniqueFd fd(::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
            if (!fd) throw py::value_error("cannot open " + path);
            const off_t size = ::lseek(fd.get(), 0, SEEK_END);
            if (size < static_cast<off_t>(output_maps::kMinBytes)) throw py::value_error("the file is under 1 MiB");
            uint8_t* map = output_maps::acquire(fd.get(), static_cast<uint64_t>(size), path);
            if (!map) throw py::value_error("no mapping free");
            if (::ftruncate(fd.get(), size / 2) != 0) throw py::value_error("cannot truncate " + path);
            bool reported = false;
            {
                py::gil_scoped_release nogil;
                for (off_t at = size / 2; at < size; at += 4096) map[at] = 0x5a;
                reported = !output_maps::done(map);
            }
            return reported;
        },
        py::arg("path"),
        "Test hook: maps `path` (1 MiB or more) as write_archives maps a file it writes over, truncates it to half "
        "and writes its second half through the mapping; whether the writer's check reports the file as shrunk "
        "(without the guard the writes kill the process with SIGBUS).");
}

}  // namespace pyckpt::bindings

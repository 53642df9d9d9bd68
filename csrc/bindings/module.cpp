// pyckpt._core: converts Python arguments, releases the GIL around the C++ core, and maps C++
// exceptions to Python ones. No logic beyond that lives here; this file holds what is
// module-wide (doc, exception classes and translation) and each register_<concern>.cpp the rest.
//
// GIL contract: every entry point is called with the GIL held; arguments are converted (and
// inline bytes copied) before the GIL is released, so other Python threads may run while
// the core works. The only Python calls made during execution happen on this thread from
// the progress hook, which reacquires the GIL first.
#include <system_error>

#include "common.hpp"

namespace py = pybind11;
using namespace pyckpt;
using namespace pyckpt::bindings;

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

    register_executor(m);
    register_archive(m);
    register_crc(m);
    register_pickle(m);
#ifdef PYCKPT_TESTING
    register_testing(m);  // the test build only (CMakeLists.txt, PYCKPT_TESTING)
#endif
    register_fsops(m);
}

#!/usr/bin/env bash
# Builds pyckpt's native module with AddressSanitizer + UndefinedBehaviorSanitizer and runs the
# tests that drive it hardest (the native core, fault injection, hostile input, properties and
# fuzzing) against that build. Extra arguments go to pytest, e.g. `-k shrink` or a longer fuzz
# budget through PYCKPT_FUZZ_EXAMPLES. Needs scripts/setup.sh to have run (it uses .venv), cmake
# and a GCC with its sanitizer runtimes.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# The normal install builds in an isolated environment; this build needs pybind11 here (pinned).
PIP_CONSTRAINT="$PWD/constraints.txt" python -m pip install --quiet pybind11
BUILD=build/sanitize
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
# With the test hooks (PYCKPT_TESTING): the fault-injection and portable-kernel tests run under the sanitizers too.
# Debug: no optimisation flags of CMake's own; CMakeLists.txt sets the sanitizer build's (-O2, bindings -O0).
cmake -S . -B "$BUILD/cmake" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Debug -DPYCKPT_SANITIZE=ON \
  -DPYCKPT_TESTING=ON -DPython_EXECUTABLE="$(command -v python)" \
  -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" >/dev/null
cmake --build "$BUILD/cmake" >/dev/null
# An importable copy of the package with the instrumented module, put first on PYTHONPATH.
rm -rf "$BUILD/pkg" && mkdir -p "$BUILD/pkg"
cp -r pyckpt "$BUILD/pkg/pyckpt"
find "$BUILD/pkg/pyckpt" -name '_core*.so' -delete
cp "$BUILD"/cmake/_core*.so "$BUILD/pkg/pyckpt/"
# An editable install (pip install -e .) resolves `pyckpt` through an import hook that outranks
# PYTHONPATH; drop it in these processes so the copy above is what gets imported.
cat > "$BUILD/pkg/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
PY
# Python itself is not instrumented, so the ASan runtime must be loaded before anything else, and
# libstdc++ with it (ASan resolves its C++ exception interceptor at start-up). Leak checking is
# off: the interpreter keeps objects alive until exit by design.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)"
# Reports go to files as well as being fatal: pytest's capture would swallow them from stderr.
REPORTS="$PWD/$BUILD/reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allow_user_segv_handler=1:handle_sigbus=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$REPORTS/ubsan"
export PYTHONPATH="$PWD/$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}"
export PYCKPT_EXPECT_SANITIZED=1
if [ $# -eq 0 ]; then
  set -- tests/native/test_core.py tests/native/test_native_faults.py tests/native/test_archive_window.py \
    tests/dcp/test_dcp_hostile.py \
    tests/universal/test_hostile_paths_and_metadata.py tests/cli/test_hostile_cli_input.py \
    tests/formats/test_torch_save_file.py tests/deepspeed/save/test_slot_save.py \
    $(ls tests/planning/test_properties.py tests/formats/test_fuzz.py tests/formats/test_fuzz_regressions.py 2>/dev/null)
fi
status=0
# Two processes as in scripts/test.sh (each ASan report file is named by its process id).
N=${PYCKPT_TEST_PROCESSES:-2}
PARALLEL=()
[ "$N" = 0 ] || PARALLEL=(-n "$N" --dist loadfile)
pytest -q -p no:cacheprovider "${PARALLEL[@]}" "$@" || status=$?
if compgen -G "$REPORTS/*" >/dev/null; then
  echo "sanitizer reports:" >&2
  cat "$REPORTS"/* >&2
  exit 1
fi
exit "$status"

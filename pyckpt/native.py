"""The one place that imports the native module, with an error that says what to do if it is missing."""

try:
    from . import _core  # noqa: F401
except ImportError as exc:  # most often: running from the source folder, which has no built module
    raise ImportError("pyckpt's native module pyckpt._core is not built here. Install the package "
                      "(`pip install .`, or scripts/setup.sh) and run from outside the source folder, or use an "
                      "editable install (`pip install --no-build-isolation -e .`).") from exc

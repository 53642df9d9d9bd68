"""DeepSpeed's rules: how a ZeRO checkpoint is laid out (discovery, the schema of its pickled
metadata, parameter names), and how ZeRO-1/2, ZeRO-3, AutoTP and AutoEP state maps onto the
Universal Checkpoint layout, expressed as plans of byte copies."""

# The public face of the load backend (``import pyckpt.deepspeed; pyckpt.deepspeed.enable()``) and
# of the save glue, the name DeepSpeed users look for. They are capabilities above this layer, so
# they are resolved on first use rather than imported here.
_BACKEND = {"enable": "pyckpt.load_universal", "disable": "pyckpt.load_universal",
            "enabled": "pyckpt.load_universal", "load_checkpoint": "pyckpt.load_universal",
            "save_checkpoint": "pyckpt.save", "SaveError": "pyckpt.save", "CollectiveCallError": "pyckpt.save"}


def __getattr__(name):
    if name in _BACKEND:
        import importlib

        return getattr(importlib.import_module(_BACKEND[name]), name)
    raise AttributeError(f"module 'pyckpt.deepspeed' has no attribute {name!r}")

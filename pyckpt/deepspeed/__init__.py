"""DeepSpeed's rules: how a ZeRO checkpoint is laid out (discovery, the schema of its pickled
metadata, parameter names), and how ZeRO-1/2, ZeRO-3, AutoTP and AutoEP state maps onto the
Universal Checkpoint layout, expressed as plans of byte copies."""

# The public face of the load backend (``import pyckpt.deepspeed; pyckpt.deepspeed.enable()``), the
# name DeepSpeed users look for. It is a capability above this layer, so it is resolved on first
# use rather than imported here.
_BACKEND = {"enable", "disable", "enabled", "load_checkpoint"}


def __getattr__(name):
    if name in _BACKEND:
        import importlib

        return getattr(importlib.import_module("pyckpt.load_universal"), name)
    raise AttributeError(f"module 'pyckpt.deepspeed' has no attribute {name!r}")

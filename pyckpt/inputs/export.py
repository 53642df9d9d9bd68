"""Hugging Face model files from any checkpoint pyckpt reads (``pyckpt.export_hf``)."""

from __future__ import annotations

from ..dcp.to_hf import export_hf_from_dcp
from ..huggingface.export import ExportReport
from ..huggingface.export import export_hf as export_deepspeed_hf
from .dispatch import DCP, open_checkpoint


def export_hf(input, output, **options) -> ExportReport:
    """``pyckpt.export_hf``: Hugging Face model files in the new folder ``output`` from any checkpoint pyckpt
    reads: a DCP folder (:func:`pyckpt.dcp.to_hf.export_hf_from_dcp`: ``model_key``, ``config``,
    ``from_torchtitan`` besides the common options), or a DeepSpeed ZeRO or Universal Checkpoint
    (:func:`pyckpt.huggingface.export.export_hf`, whose options apply)."""
    if open_checkpoint(input).kind == DCP:
        return export_hf_from_dcp(input, output, **options)
    return export_deepspeed_hf(input, output, **options)

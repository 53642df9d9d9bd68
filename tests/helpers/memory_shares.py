"""Node shares of the memory tier as a node's leader publishes them, for the tests that lay a tier out
without DeepSpeed: the job folder's record (pyckpt-job.json), DeepSpeed-shaped model-state files that
record a step, and each share's manifest describing the files already in its folder (sizes and CRC-32s,
by pyckpt's own describe)."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from pyckpt.deepspeed.tiers import job_identity as ji
from pyckpt.deepspeed.tiers import node_manifest as nm

RUN = "0123456789abcdef" * 2
PARAMS = OrderedDict([("layer.weight", (4, 3)), ("layer.bias", (4, ))])


def model_states(path, step: int, **extra) -> None:
    """A ZeRO-1/2 model-state file of mp rank 0 as DeepSpeed 0.19.8 writes it, recording ``step``."""
    state = {"module": OrderedDict((n, torch.zeros(s)) for n, s in PARAMS.items()),
             "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in PARAMS.items())],
             "frozen_param_shapes": None, "buffer_names": [], "global_steps": step, "global_samples": step * 4,
             "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 1, "ds_version": "0.19.8", "ds_config": {},
             **extra}
    torch.save(state, path)


def claim(root, job: str, save_dir, run: str = RUN) -> ji.Identity:
    """``<root>/<job>`` recorded as ``run``'s of ``save_dir`` (root and job folder made 0700, as the tier
    makes them); returns the identity the tier uses for it."""
    from pyckpt.deepspeed.tiers.memory_root import node_memory_folder

    identity = ji.Identity(job, ji.real_save_dir(save_dir), False)
    node_memory_folder(str(root), job, 0)
    ji.claim(str(root), identity, run)
    return identity


def describe(path, *, save: str, job: str, step: int, node: int = 0, nodes: int = 1, world: int = 1,
             ranks=None, model: str = "ab" * 32, run: str = RUN, save_dir) -> nm.NodeManifest:
    """The manifest of the files now in the tag folder ``path`` (its name the tag), written beside them."""
    path = str(path)
    os.chmod(path, 0o700)
    manifest = nm.NodeManifest(save, job, os.path.basename(path), step, node, nodes, world,
                               ranks or (node, 1), model, tuple(nm.describe(path)), run,
                               ji.real_save_dir(save_dir))
    nm.write(path, manifest)
    return manifest

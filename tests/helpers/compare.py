"""Tensor-by-tensor, key-by-key comparison of two checkpoint folders (test helper).

Tensors must match in dtype, shape, requires_grad and every bit (compared as raw bytes, so -0.0
vs 0.0 or different NaN payloads count as differences). Trusted files only: this unpickles with
DeepSpeed's classes importable, as DeepSpeed's own loader would.
"""

from __future__ import annotations

import enum
import filecmp
import hashlib
import os
import stat
from typing import List

import torch


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def diff_objects(a, b, where: str, out: List[str]) -> None:
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            out.append(f"{where}: tensor vs {type(b).__name__ if torch.is_tensor(a) else type(a).__name__}")
            return
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            out.append(f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif a.requires_grad != b.requires_grad:
            out.append(f"{where}: requires_grad {a.requires_grad} vs {b.requires_grad}")
        elif _tensor_bytes(a) != _tensor_bytes(b):
            out.append(f"{where}: tensor values differ")
        return
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)):
        out.append(f"{where}: {type(a).__name__} vs {type(b).__name__}")
        return
    if isinstance(a, dict):
        if type(a) is not type(b):
            out.append(f"{where}: {type(a).__name__} vs {type(b).__name__}")
        if list(a.keys()) != list(b.keys()):
            out.append(f"{where}: keys {list(a.keys())} vs {list(b.keys())}")
            return
        for k in a:
            diff_objects(a[k], b[k], f"{where}[{k!r}]", out)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} vs {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            diff_objects(x, y, f"{where}[{i}]", out)
    elif isinstance(a, enum.Enum) or isinstance(a, (int, float, str, bool, type(None), torch.Size, set, frozenset)):
        if a != b and not (isinstance(a, float) and a != a and b != b):
            out.append(f"{where}: {a!r} vs {b!r}")
    elif hasattr(a, "__dict__"):
        diff_objects(vars(a), vars(b), f"{where}.__dict__", out)
    elif a != b:
        out.append(f"{where}: {a!r} vs {b!r}")


def diff_folders(expected: str, actual: str, skip=("tmp", )) -> List[str]:
    """Differences between two universal checkpoint folders; [] when equal."""
    out: List[str] = []

    def files(root):
        found = set()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if os.path.relpath(os.path.join(dirpath, d), root) not in skip]
            for f in filenames:
                found.add(os.path.relpath(os.path.join(dirpath, f), root))
        return found

    fe, fa = files(expected), files(actual)
    for f in sorted(fe - fa):
        out.append(f"missing file {f}")
    for f in sorted(fa - fe):
        out.append(f"unexpected file {f}")
    for f in sorted(fe & fa):
        pe, pa = os.path.join(expected, f), os.path.join(actual, f)
        if filecmp.cmp(pe, pa, shallow=False):
            continue  # byte-identical (copied model-state files)
        a = torch.load(pe, map_location="cpu", weights_only=False)
        b = torch.load(pa, map_location="cpu", weights_only=False)
        diff_objects(a, b, f, out)
    return out


def digest(folder) -> dict:
    """{relative path: sha256} of every file below ``folder`` (a link: its target's name): proves a folder
    was left untouched."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(dirpath, f)
            if os.path.islink(path):  # a link is its target's name: it may dangle, loop or leave the folder
                out[os.path.relpath(path, folder)] = "link:" + os.readlink(path)
                continue
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):  # a FIFO would block the open
                out[os.path.relpath(path, folder)] = f"special:{stat.S_IFMT(mode)}"
                continue
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out

"""A lazy state dict: a DeepSpeed checkpoint's consolidated tensors, each read when it is asked for.

What ``get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)`` is for: picking a few
tensors out of a huge checkpoint without reading the rest. Listing the keys reads only metadata;
``sd[name]`` gathers that tensor's bytes from the memory-mapped shards into a new torch tensor
(cast on the way when a dtype is given). torch is imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, Optional

from ..zero.consolidated import cast
from ..execution.executor import gather_tensor
from ..universal.input import read_consolidated
from ..tensors import FLOATING, dtype_named



class LazyStateDict(Mapping):
    def __init__(self, input, dtype: Optional[str] = None, exclude_frozen_parameters: bool = False):
        ck, self._state = read_consolidated(input, exclude_frozen=exclude_frozen_parameters)
        if dtype is not None and dtype_named(dtype) is None:
            raise ValueError(f"dtype {dtype!r} is not one of fp32, bf16, fp16")
        self._dtype = dtype_named(dtype) if dtype is not None else None
        self.folder = ck.folder

    def __iter__(self) -> Iterator[str]:
        return iter(self._state.names())

    def __len__(self) -> int:
        return len(self._state.tensors) + len(self._state.aliases)

    def __contains__(self, name) -> bool:
        return name in self._state.tensors or name in self._state.aliases

    def __getitem__(self, name: str):
        import torch

        if name not in self:
            raise KeyError(name)
        t = self._state.tensors[self._state.aliases.get(name, name)]
        if self._dtype is not None and t.dtype in FLOATING:
            t = cast(t, self._dtype)
        out = torch.empty(tuple(t.shape), dtype=getattr(torch, t.dtype))
        if out.numel():
            gather_tensor(t, out.view(-1).view(torch.uint8).numpy())
        return out

    def __repr__(self) -> str:
        return f"LazyStateDict({self.folder!r}, {len(self)} tensors)"


def state_dict(input, *, dtype: Optional[str] = None, exclude_frozen_parameters: bool = False) -> LazyStateDict:
    """The consolidated state dict of a ZeRO checkpoint (``zero_to_fp32``'s keys, order and values;
    tied aliases included, as the same values), each tensor read when it is accessed. ``input`` may
    also be a Universal Checkpoint made from one, which holds the same state dict."""
    return LazyStateDict(input, dtype, exclude_frozen_parameters)

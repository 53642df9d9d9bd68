"""The optional conversions of a published checkpoint, run by all ranks together after the save.

``universal=True`` writes ``<tag>_universal`` (``latest_universal`` names it), ``export="hf"`` writes
``<tag>_hf``. A synchronous save converts before it returns, an asynchronous one at its join (the
conversions are collective, so they run on the caller's thread). The checkpoint itself is published
by then: a conversion that fails says so (``published=True``) and leaves it in place.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from ...execution.distributed import TorchRanks, describe_failure
from .outcome import report_failure
from .retention import read_checkpoint, replace_problem


def convert_published(save_dir: str, tag: str, universal: bool, export: Optional[str], on_error: str,
                      rank: int) -> bool:
    """The optional conversions of the published checkpoint, by all ranks together."""
    if not universal and not export:
        return True
    ranks = TorchRanks()
    source = os.path.join(save_dir, tag)
    jobs: List[Any] = []
    if universal:
        from ...universal.convert import convert_to_universal

        jobs.append(("a Universal Checkpoint", os.path.join(save_dir, f"{tag}_universal"), convert_to_universal, {}))
    if export == "hf":
        from ...huggingface.export import export_hf

        jobs.append(("a Hugging Face export", os.path.join(save_dir, f"{tag}_hf"), export_hf, {}))
    for what, output, run, kwargs in jobs:
        # a folder of that name that is not such a conversion is someone's (it may have appeared since
        # the preflight, an asynchronous save's conversion runs at its join): rank 0 looks, all agree
        problem = ranks.broadcast(replace_problem(output, output[len(source):], read_checkpoint(source))
                                  if rank == 0 else None)
        if problem:
            return report_failure(f"checkpoint {tag} was saved in {save_dir} (latest names it), but it was not "
                                  f"converted to {what}: {problem}", on_error, rank, published=True)
        try:
            run(source, output, overwrite=True, ranks=ranks, **kwargs)
        except Exception as exc:
            return report_failure(f"checkpoint {tag} was saved in {save_dir} (latest names it), but converting it "
                                  f"to {what} at {output} failed: {describe_failure(exc)}", on_error, rank,
                                  published=True)
    return True

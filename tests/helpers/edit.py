"""Editing real checkpoint files for error-case tests, without unpickling code (pyckpt's own reader
and writer: the file keeps every tensor record, only the edited metadata changes)."""

import os
import shutil
from pathlib import Path


def copy_checkpoint(folder, tmp_path) -> tuple[Path, Path]:
    """(root, root / folder.name): a copy under ``tmp_path / "ckpt"`` of the checkpoint folder holding
    ``folder`` (a tag folder beside ``latest``, or a conversion beside ``latest_universal``), for a test that
    damages files. The session's checkpoints are read by every test of the run, so none is edited in place;
    links are copied as links, so a copy never writes through one into the original."""
    folder = Path(folder)
    root = Path(tmp_path) / "ckpt"
    shutil.copytree(folder.parent, root, symlinks=True)
    return root, root / folder.name


def rewrite(path, edit) -> None:
    """Apply ``edit(obj)``, which changes the pickled object of ``path`` in place (its return value is ignored)."""
    from pyckpt.formats.torch_zip import SourceFile
    from pyckpt.execution.executor import execute
    from pyckpt.planning.plan import Plan

    sf = SourceFile(path)
    obj = sf.load()
    edit(obj)
    staging = os.path.join(os.path.dirname(path), ".edit-staging")
    os.makedirs(staging, exist_ok=True)
    plan = Plan()
    name = os.path.basename(path)
    plan.add_archive(name, obj)
    execute(plan, staging, workers=1)
    os.replace(os.path.join(staging, name), path)
    shutil.rmtree(staging)

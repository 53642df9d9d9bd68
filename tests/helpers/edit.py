"""Editing real checkpoint files for error-case tests, without unpickling code (pyckpt's own reader
and writer: the file keeps every tensor record, only the edited metadata changes)."""

import os
import shutil


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

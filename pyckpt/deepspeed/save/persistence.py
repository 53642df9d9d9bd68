"""A memory checkpoint persisted: copied from the node folders of the memory tier to ``save_dir``.

Every ``persist_every``-th memory checkpoint, one saved with ``persist=True``, and the newest one at a
job's normal end (:mod:`.memory_save`) is copied to ``save_dir`` in the background once its memory
copy is published, by the node leaders together, with the durable save's rules: rank 0 takes a hidden
staging folder under the tag's lock, every leader copies its node's files into it, rank 0 renames it
into place once all did, ``latest`` last, an existing tag replaced only when it is a checkpoint of the
same model, ``keep_last`` after. A failed persistence is logged by its join; the memory copy stays.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

from ...execution.distributed import describe_failure
from ...execution.durable import fsync_path
from ...execution.publisher import Publisher
from ..tiers import node_manifest as nm
from ..tiers.folder_walk import tag_files
from .background import AsyncSave, StoreAgreement
from .retention import keep_last as prune
from .retention import read_checkpoint, replace_problem

log = logging.getLogger("pyckpt")


def persist_checkpoint(saved, links, folder: str, save_dir: str, tag: str, keep: Optional[int], fsync: bool,
                       store, timeout: float, save_id: str) -> tuple:
    """Each node's leader, in the background: the published memory checkpoint ``folder/<tag>`` copied to
    ``save_dir/<tag>`` once ``saved`` (the memory save's outcome, or its handle) succeeded. Node 0's
    leader (rank 0) stages and publishes, the others copy their node's files into its staging folder;
    they meet in the store under the save's id. Returns (ok, why not), the same on every leader."""
    if isinstance(saved, AsyncSave):
        if saved._thread is not None:
            saved._thread.join()  # its outcome, without taking its report from the caller's join
        ok = bool(saved.ok)
    else:
        ok = bool(saved)
    ns = f"persist/{save_id}/{tag}/"
    ready = StoreAgreement(store, ns + "ready", links.node, links.count, timeout)
    done = StoreAgreement(store, ns + "done", links.node, links.count, timeout)
    source = os.path.join(folder, tag)
    if links.node != 0:
        try:
            go, staging = ready.result()
        except Exception as exc:
            return False, f"checkpoint {tag} was not persisted: node 0 did not start it ({describe_failure(exc)})"
        outcome = None
        if go:
            try:
                if not ok:
                    raise RuntimeError("its memory save did not succeed")
                copy_share(source, staging, fsync)
            except Exception as exc:
                outcome = f"node {links.node}: {describe_failure(exc)}"
        done.post(outcome)
        try:
            return tuple(done.result())
        except Exception as exc:
            return False, f"checkpoint {tag}: no outcome of its persistence came ({describe_failure(exc)})"
    announced = []

    def stage_and_publish() -> tuple:
        if not ok:
            return False, f"checkpoint {tag} was not persisted to {save_dir}: its memory save did not succeed"
        record = read_checkpoint(source)
        with Publisher(os.path.join(save_dir, tag), overwrite=True, fsync=fsync, pointer="latest") as out:
            problem = replace_problem(out.output, reference=record)
            if problem:
                return False, f"checkpoint {tag} was not persisted: {problem}"
            ready.announce(True, out.staging)
            announced.append(True)
            outcome = None
            try:
                copy_share(source, out.staging, fsync)
            except Exception as exc:
                outcome = f"node 0: {describe_failure(exc)}"
            done.post(outcome)
            try:
                outcomes = done.gather()
            except TimeoutError as exc:
                outcomes = [str(exc)]
            bad = [o for o in outcomes if o]
            if bad:
                return False, f"checkpoint {tag} was not persisted to {save_dir}: {'; '.join(bad)}"
            out.publish()
        return True, None

    try:
        result = stage_and_publish()
    except Exception as exc:
        result = (False, f"persisting checkpoint {tag} to {save_dir} failed: {describe_failure(exc)}")
    finally:
        if not announced:  # the other leaders wait for this: they hear it was not started
            ready.announce(False, None)
    if result[0] and keep:
        try:
            prune(save_dir, keep, newest=tag)
        except Exception as exc:
            log.warning("pyckpt: keep_last=%d could not prune %s: %s", keep, save_dir, describe_failure(exc))
    done.announce(*result)
    if result[0]:
        log.info("pyckpt: persisted %s to %s", tag, os.path.join(save_dir, tag))
    return result


def copy_share(source: str, dest: str, fsync: bool) -> None:
    """The memory checkpoint's files into the staging folder (the kernel copies: copy_file_range /
    sendfile, the GIL released), found by the tier's one walk (:func:`..tiers.folder_walk.tag_files`: no
    link followed, anything but a regular file or a folder refused, as a published share holds none). The
    node manifest is pyckpt's, not DeepSpeed's: it stays behind."""
    made = {dest}
    for found in tag_files(source):
        if found.name == nm.NAME:
            continue
        target = os.path.join(dest, *found.name.split("/"))
        folder = os.path.dirname(target)
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        shutil.copyfile(found.path, target, follow_symlinks=False)
        if fsync:
            fsync_path(target)

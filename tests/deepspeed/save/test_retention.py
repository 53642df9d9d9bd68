"""keep_last and the save's tag: what a save may remove or replace in ``save_dir``.

Only this job's own checkpoints (a DeepSpeed model-state file read by pyckpt's reader, naming the
parameters of the checkpoint just published) are counted, ordered by the step they record, and
removed beyond the K newest; a save replaces an existing tag only when it is such a checkpoint. The
last test fuzzes the neighbourhood (sibling folders and files, links, pointers, tags, clocks) with
the oracle "nothing but this job's own older checkpoints is ever removed". The DeepSpeed runs are
in tests/deepspeed/save/test_async_save.py and tests/deepspeed/save/test_save_glue.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyckpt.deepspeed.save.destination import SharedFolder
from pyckpt.deepspeed.save.request import SaveRequest
from pyckpt.deepspeed.save.retention import (PointerUnreadable, checkpoints, keep_last, read_checkpoint,
                                             read_pointer, replace_problem)

HOLD = ("import sys; from pyckpt.execution.output_lock import OutputLock; lock = OutputLock(sys.argv[1]); "
        "print('locked', flush=True); sys.stdin.read(); lock.release()")
PARAMS = OrderedDict([("layer.weight", (4, 3)), ("layer.bias", (4,))])
OTHER_MODEL = OrderedDict([("proj.weight", (8, 8))])
ZERO12, ZERO3 = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _replace_problem(save_dir: str, tag: str, universal: bool, export):
    """What the shared folder refuses to replace, for a save of ``tag`` into ``save_dir``."""
    return SharedFolder().replacement_problem(SaveRequest(save_dir, tag, universal=universal, export=export), None)


def model_states(step: int, params=PARAMS, **extra) -> dict:
    """A model-state dict as DeepSpeed 0.19.8's engine saves it (the keys keep_last reads)."""
    state = {"module": OrderedDict((n, torch.zeros(s)) for n, s in params.items()),
             "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in params.items())],
             "frozen_param_shapes": None, "buffer_names": [], "global_steps": step, "global_samples": step * 8,
             "skipped_steps": 0, "dp_world_size": 2, "mp_world_size": 1, "ds_version": "0.19.8", "ds_config": {}}
    state.update(extra)
    return state


def checkpoint(root, name, step, *, params=PARAMS, file=ZERO12, age=None):
    """A checkpoint folder of ``step`` (its model-state file and a shard), its mtime ``age`` s ago."""
    folder = root / name
    folder.mkdir()
    torch.save(model_states(step, params), folder / file)
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"shard")
    if age is not None:
        t = time.time() - age
        os.utime(folder, (t, t))
    return folder


def hf_export(root, name, extra=()):
    folder = root / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "config.json").write_text("{}")
    for n in extra:
        (folder / n).write_text("mine")
    return folder


def universal(root, name, step, params=PARAMS):
    folder = root / name
    (folder / "zero" / "layer.weight").mkdir(parents=True)
    torch.save(model_states(step, params), folder / ZERO12)
    return folder


def tree(root) -> dict:
    """Every entry under ``root``: its kind and, for a file, its bytes' digest (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
            else:
                out[rel] = ("other",)
    return out


# -- which folders count, in which order ---------------------------------------------------------------


def test_keep_last_removes_the_oldest_steps_beyond_k(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint(tmp_path, f"global_step{step}", step)
    (tmp_path / "latest").write_text("global_step40")
    assert checkpoints(str(tmp_path), "global_step40") == ["global_step10", "global_step20", "global_step30",
                                                           "global_step40"]
    assert keep_last(str(tmp_path), 2, newest="global_step40") == ["global_step10", "global_step20"]
    assert sorted(os.listdir(tmp_path)) == ["global_step30", "global_step40", "latest"]


def test_a_user_folder_named_like_a_checkpoint_file_is_not_a_checkpoint(tmp_path):
    """A file called *expert_*.pt, zero_pp_rank_*.pt or even mp_rank_00_model_states.pt does not make a
    folder a checkpoint: its model-state file must be DeepSpeed's, of this job."""
    checkpoint(tmp_path, "old", 1)
    checkpoint(tmp_path, "new", 2)
    analysis = tmp_path / "analysis"
    analysis.mkdir()
    (analysis / "expert_counts.pt").write_bytes(b"mine")
    (analysis / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"mine")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / ZERO12).write_bytes(b"not a torch file")
    torch_file = tmp_path / "stats"
    torch_file.mkdir()
    torch.save({"global_steps": 0, "counts": torch.ones(3)}, torch_file / ZERO12)  # a dict, not DeepSpeed's
    other = checkpoint(tmp_path, "other_model", 0, params=OTHER_MODEL)  # DeepSpeed's, another job's
    before = {p: tree(tmp_path / p) for p in ("analysis", "junk", "stats", "other_model")}
    assert keep_last(str(tmp_path), 1, newest="new") == ["old"]
    assert {p: tree(tmp_path / p) for p in ("analysis", "junk", "stats", "other_model")} == before
    assert other.is_dir() and sorted(os.listdir(tmp_path)) == ["analysis", "junk", "new", "other_model", "stats"]


def test_order_is_the_recorded_step_never_the_folder_time(tmp_path):
    checkpoint(tmp_path, "global_step100", 100, age=10)
    checkpoint(tmp_path, "global_step200", 200, age=5)
    checkpoint(tmp_path, "global_step300", 300, age=0)
    # someone touches the oldest checkpoint: it becomes the newest folder by time, not by step
    os.utime(tmp_path / "global_step100", None)
    assert keep_last(str(tmp_path), 2, newest="global_step300") == ["global_step100"]
    assert sorted(os.listdir(tmp_path)) == ["global_step200", "global_step300"]


def test_the_tag_just_published_is_the_newest_whatever_its_step(tmp_path):
    checkpoint(tmp_path, "run1_step50", 50)
    checkpoint(tmp_path, "run2_step10", 10)  # training restarted from step 0 and saved again
    assert keep_last(str(tmp_path), 1, newest="run2_step10") == ["run1_step50"]


def test_a_model_state_file_that_is_a_link_or_a_fifo_makes_no_checkpoint(tmp_path):
    real = checkpoint(tmp_path, "real", 1)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ZERO12).symlink_to(real / ZERO12)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ZERO12)  # opened without O_NONBLOCK this would block forever
    checkpoint(tmp_path, "new", 2)
    assert read_checkpoint(str(linked)) is None and read_checkpoint(str(fifo)) is None
    assert keep_last(str(tmp_path), 1, newest="new") == ["real"]
    assert sorted(os.listdir(tmp_path)) == ["fifo", "linked", "new"]


def test_a_zero3_checkpoint_counts_by_its_own_model_state_file(tmp_path):
    checkpoint(tmp_path, "a", 1, file=ZERO3)
    checkpoint(tmp_path, "b", 2, file=ZERO3)
    checkpoint(tmp_path, "zero12_same_params", 0)  # another layout: another job
    assert keep_last(str(tmp_path), 1, newest="b") == ["a"]
    assert sorted(os.listdir(tmp_path)) == ["b", "zero12_same_params"]


def test_nothing_is_removed_when_the_newest_is_no_readable_checkpoint(tmp_path, caplog):
    checkpoint(tmp_path, "old", 1)
    (tmp_path / "new").mkdir()
    assert keep_last(str(tmp_path), 1, newest="new") == []
    assert sorted(os.listdir(tmp_path)) == ["new", "old"]
    assert "removed nothing" in caplog.text


def test_keep_last_spares_what_a_pointer_names_and_what_another_run_holds(tmp_path):
    for step, name in enumerate(["a", "b", "c", "d"]):
        checkpoint(tmp_path, name, step)
    (tmp_path / "latest").write_text("d\n")
    (tmp_path / "latest_universal").write_text("a_universal")
    universal(tmp_path, "a_universal", 0)  # a conversion, not counted as a checkpoint; a pointer names it
    hf_export(tmp_path, "b_hf")
    # another run converting `c` holds its lock (a process of its own: POSIX locks are per process)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "c")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd="/")
    try:
        assert holder.stdout.readline() == b"locked\n"
        removed = keep_last(str(tmp_path), 1, newest="d")
    finally:
        holder.communicate(b"")
    # `a` goes (its universal conversion stays: latest_universal names it), `b` and its export go,
    # `c` is locked, `d` is the newest
    assert removed == ["a", "b", "b_hf"]
    assert sorted(os.listdir(tmp_path)) == ["a_universal", "c", "d", "latest", "latest_universal"]


def test_a_conversion_goes_with_its_checkpoint_only_when_it_is_what_pyckpt_writes(tmp_path):
    for step, name in enumerate(["a", "b", "c", "new"]):
        checkpoint(tmp_path, name, step)
    universal(tmp_path, "a_universal", 0)
    hf_export(tmp_path, "a_hf")
    hf_export(tmp_path, "b_hf", extra=["notes.txt"])  # the user's file: not an export any more
    (tmp_path / "b_universal").mkdir()  # no zero/: someone's folder
    (tmp_path / "b_universal" / "results.csv").write_text("mine")
    universal(tmp_path, "c_universal", 0, params=OTHER_MODEL)  # another model's Universal Checkpoint
    assert keep_last(str(tmp_path), 1, newest="new") == ["a", "a_universal", "a_hf", "b", "c"]
    assert sorted(os.listdir(tmp_path)) == ["b_hf", "b_universal", "c_universal", "new"]
    assert (tmp_path / "b_hf" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("hostile", ["link to a secret", "link to /proc", "fifo", "folder"])
def test_keep_last_neither_follows_nor_trusts_a_pointer_that_is_no_plain_file(tmp_path, hostile):
    root = tmp_path / "ckpt"
    root.mkdir()
    for step, name in enumerate(["a", "b", "c"]):
        checkpoint(root, name, step)
    secret = tmp_path / "secret"
    secret.write_text("b")
    latest = root / "latest"
    if hostile == "link to a secret":
        latest.symlink_to(secret)
    elif hostile == "link to /proc":
        latest.symlink_to("/proc/self/environ")
    elif hostile == "fifo":
        os.mkfifo(latest)  # an open without O_NONBLOCK would wait here for a writer
    else:
        latest.mkdir()
    with pytest.raises(PointerUnreadable, match="latest"):
        read_pointer(str(root))
    # what latest names cannot be known, so nothing is pruned
    with pytest.raises(PointerUnreadable):
        keep_last(str(root), 1, newest="c")
    assert sorted(p.name for p in root.iterdir() if p.name != "latest") == ["a", "b", "c"]
    assert secret.read_text() == "b"


def test_a_checkpoint_folder_that_is_a_link_is_neither_counted_nor_removed(tmp_path):
    outside = checkpoint(tmp_path, "outside", 0)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "old").symlink_to(outside)
    checkpoint(root, "new", 5)
    assert checkpoints(str(root), "new") == ["new"]
    assert keep_last(str(root), 1, newest="new") == []
    assert (outside / ZERO12).exists() and (root / "old").is_symlink()


# -- what a save may replace ------------------------------------------------------------------------------


def test_a_save_replaces_a_tag_only_when_it_is_a_checkpoint(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "important.txt").write_text("mine")
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "alink").symlink_to(checkpoint(tmp_path, "real", 1))
    problem = _replace_problem(str(tmp_path), "notes", False, None)
    assert problem and str(notes) in problem and "not a DeepSpeed checkpoint" in problem
    assert "not a folder" in _replace_problem(str(tmp_path), "afile", False, None)
    assert "not a folder" in _replace_problem(str(tmp_path), "alink", False, None)
    assert _replace_problem(str(tmp_path), "real", False, None) is None
    assert _replace_problem(str(tmp_path), "absent", False, None) is None
    # the conversions a save asks for are held to the same rule
    hf_export(tmp_path, "real_hf", extra=["notes.txt"])
    assert "Hugging Face export" in _replace_problem(str(tmp_path), "real", False, "hf")
    (tmp_path / "real_universal").mkdir()
    assert "Universal Checkpoint" in _replace_problem(str(tmp_path), "real", True, None)
    # and, once the new checkpoint is written, the one it replaces must be of the same model
    other = read_checkpoint(str(checkpoint(tmp_path, "other", 1, params=OTHER_MODEL)))
    assert "another model" in replace_problem(str(tmp_path / "real"), reference=other)
    assert (notes / "important.txt").read_text() == "mine"


# -- fuzz: the whole neighbourhood ------------------------------------------------------------------------

EXAMPLES = max(1, int(os.environ.get("PYCKPT_FUZZ_EXAMPLES", "1000")) // 5)  # each builds a folder tree

SIBLING_FILES = ["expert_counts.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", ZERO12, ZERO3,
                 "layer_0_expert_0_mp_rank_00_model_states.pt", "notes.txt", "model.safetensors", "config.json"]
CONTENTS = ["junk", "other model", "this model", "dict", "empty"]


def _write_file(path, content, step):
    if content == "junk":
        path.write_bytes(b"\x00PK\x03\x04 not a checkpoint")
    elif content == "other model":
        torch.save(model_states(step, OTHER_MODEL), path)
    elif content == "this model":  # a job's model-state file under a name keep_last does not read, or does
        torch.save(model_states(step), path)
    elif content == "dict":
        torch.save({"global_steps": step}, path)
    else:
        path.write_bytes(b"")


sibling = st.tuples(
    st.sampled_from(["folder", "file", "link to job checkpoint", "link outside", "fifo", "hf", "universal"]),
    st.lists(st.tuples(st.sampled_from(SIBLING_FILES), st.sampled_from(CONTENTS)), max_size=3),
    st.integers(0, 60))


@pytest.mark.fuzz
@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.integers(0, 50), min_size=1, max_size=5),
       ages=st.lists(st.integers(0, 1000), min_size=5, max_size=5),
       names=st.lists(st.sampled_from(["global_step", "ckpt-", "step_", "x"]), min_size=5, max_size=5),
       siblings=st.lists(sibling, max_size=6),
       conversions=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["_hf", "_universal"]),
                                      st.booleans()), max_size=3),
       latest=st.one_of(st.none(), st.integers(0, 12), st.sampled_from(["link", "fifo", "junk", "folder"])),
       k=st.integers(1, 4), tag=st.integers(0, 12))
def test_fuzz_nothing_but_this_jobs_older_checkpoints_is_ever_removed(tmp_path_factory, steps, ages, names,
                                                                      siblings, conversions, latest, k, tag):
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "ckpt"
    root.mkdir()
    outside = checkpoint(base, "outside", 7)
    jobs = {}  # this job's checkpoints: name -> step
    for i, step in enumerate(steps):
        name = f"{names[i]}{step}_{i}"
        checkpoint(root, name, step, age=ages[i])
        jobs[name] = step
    genuine = set()  # conversions as pyckpt writes them, of this job's checkpoints
    for index, suffix, real in conversions:
        owner = list(jobs)[index % len(jobs)]
        path = root / (owner + suffix)
        if path.exists():
            continue
        if suffix == "_hf":
            hf_export(root, owner + suffix, extra=() if real else ["notes.txt"])
        elif real:
            universal(root, owner + suffix, jobs[owner])
        else:
            path.mkdir()
            (path / "results.csv").write_text("mine")
        if real:
            genuine.add(owner + suffix)
    made = list(jobs)
    for i, (kind, files, age) in enumerate(siblings):
        path = root / f"sib{i}"
        if kind == "folder" or kind == "hf" or kind == "universal":
            path.mkdir()
            if kind == "universal":
                (path / "zero").mkdir()
            for n, content in files:
                if not (path / n).exists():
                    _write_file(path / n, content, age)
                    if (n, content) == (ZERO12, "this model") and kind != "universal":
                        jobs[path.name] = age  # planted as a sibling, but a checkpoint of this job all the same
        elif kind == "file":
            _write_file(path, files[0][1] if files else "junk", age)
        elif kind == "link to job checkpoint":
            path.symlink_to(root / made[age % len(made)])
        elif kind == "link outside":
            path.symlink_to(outside)
        else:
            os.mkfifo(path)
        if not path.is_symlink() and not path.is_fifo():
            os.utime(path, (time.time() - age, time.time() - age))
    newest = list(jobs)[len(steps) - 1]  # the one just published: the last one made before the siblings
    entries = sorted(os.listdir(root))
    pointer_ok = True
    pointed = set()
    if isinstance(latest, int):
        pointed.add(entries[latest % len(entries)])
        (root / "latest").write_text(entries[latest % len(entries)] + "\n")
    elif latest == "link":
        (root / "latest").symlink_to(outside / ZERO12)
        pointer_ok = False
    elif latest == "fifo":
        os.mkfifo(root / "latest")
        pointer_ok = False
    elif latest == "folder":
        (root / "latest").mkdir()
        pointer_ok = False
    elif latest == "junk":
        (root / "latest").write_text("no such tag")
    before, outside_before = tree(root), tree(base / "outside")

    # the save's tag check: a save may replace a folder only when it is a DeepSpeed checkpoint
    chosen = (entries + ["latest"])[tag % (len(entries) + 1)]
    problem = _replace_problem(str(root), chosen, False, None)
    if problem is None:
        path = root / chosen
        assert not os.path.lexists(path) or (read_checkpoint(str(path)) is not None and not path.is_symlink()), chosen

    try:
        removed = keep_last(str(root), k, newest=newest)
    except PointerUnreadable:
        assert not pointer_ok
        removed = []
    else:
        assert pointer_ok
    after = tree(root)
    gone = {rel.split(os.sep)[0] for rel in before if rel not in after}
    assert gone == set(removed), (gone, removed)
    # the oracle: only this job's checkpoints older than the k newest, and their genuine conversions
    by_age = sorted(jobs, key=lambda n: (n == newest, jobs[n], [int(c) if c.isdigit() else c for c in
                                                                     __import__("re").split(r"(\d+)", n)]))
    kept = set(by_age[-k:])
    for name in gone:
        if name in jobs:
            assert name not in kept and name not in pointed, name
        else:
            owner = name.rsplit("_", 1)[0] if name.endswith("_hf") else name[:-len("_universal")]
            assert name in genuine and owner in gone and name not in pointed, name
    if pointer_ok:  # the reference model: every older one goes unless a pointer names it
        assert {n for n in jobs if n in gone} == {n for n in jobs if n not in kept and n not in pointed}
    # everything else, inside the folder and out, is as it was
    for rel, entry in before.items():
        if rel.split(os.sep)[0] not in gone:
            assert after.get(rel) == entry, rel
    assert tree(base / "outside") == outside_before


@pytest.mark.parametrize("point", ["before-publish", "after-publish", "before-pointer-rename", "after-pointer"])
def test_a_persistence_killed_at_any_step_leaves_save_dir_whole_and_the_next_one_cleans(tmp_path, point):
    """The background copy of a memory checkpoint to save_dir, SIGKILLed between any two of its renames:
    save_dir holds the previous checkpoint and latest (or the new one whole), never a torn folder, and
    the next persistence removes what the killed one left and publishes."""
    memory, durable = tmp_path / "mem", tmp_path / "ckpt"
    memory.mkdir()
    durable.mkdir()
    checkpoint(memory, "s2", 2)
    checkpoint(durable, "s2", 1)  # an older save of the same tag: replacing it takes the swap path
    (durable / "latest").write_text("s2")
    # node 0 of a one-node job, meeting no other leader: a store of its own
    code = ("import sys; from types import SimpleNamespace as N; from torch.distributed import HashStore; "
            "from pyckpt.deepspeed.save.persistence import persist_checkpoint; "
            "print(persist_checkpoint(True, N(node=0, count=1), sys.argv[1], sys.argv[2], 's2', None, False, "
            "HashStore(), 60.0, save_id='x'))")
    run = subprocess.run([sys.executable, "-c", code, str(memory), str(durable)], cwd="/", capture_output=True,
                         text=True, env={**os.environ, "PYCKPT_TEST_KILL_AT": point})
    assert run.returncode == -9, run.stderr[-2000:]
    assert (durable / "latest").read_text() == "s2"
    step = read_checkpoint(str(durable / "s2"))
    assert step is not None and step.step in (1, 2)  # the old or the new, whole
    run = subprocess.run([sys.executable, "-c", code, str(memory), str(durable)], cwd="/", capture_output=True,
                         text=True)
    assert run.returncode == 0 and run.stdout.strip() == "(True, None)", run.stderr[-2000:]
    assert sorted(os.listdir(durable)) == ["latest", "s2"] and read_checkpoint(str(durable / "s2")).step == 2
    assert tree(durable / "s2") == tree(memory / "s2")


def test_a_persistence_copies_no_file_a_link_in_the_memory_share_leads_to(tmp_path):
    """A memory share whose folder holds a link (to a file or a folder outside it) is not persisted: the
    tier's walk follows no link, so nothing outside the share reaches save_dir, and save_dir keeps what it
    held."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from pyckpt.deepspeed.save.persistence import persist_checkpoint

    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "key").write_bytes(b"not the checkpoint's")
    memory, durable = tmp_path / "mem", tmp_path / "ckpt"
    memory.mkdir()
    durable.mkdir()
    for name, target in (("s2", secret / "key"), ("s3", secret)):
        checkpoint(memory, name, int(name[1:]))
        os.symlink(target, memory / name / "extra")
        ok, message = persist_checkpoint(True, SimpleNamespace(node=0, count=1), str(memory), str(durable), name,
                                         None, False, HashStore(), 60.0, save_id="x")
        assert not ok and "extra: is a symbolic link" in message, message
    assert os.listdir(durable) == []
    (memory / "s3" / "extra").unlink()
    ok, message = persist_checkpoint(True, SimpleNamespace(node=0, count=1), str(memory), str(durable), "s3", None,
                                     False, HashStore(), 60.0, save_id="y")
    assert ok, message
    assert sorted(os.listdir(durable / "s3")) == sorted(os.listdir(memory / "s3"))

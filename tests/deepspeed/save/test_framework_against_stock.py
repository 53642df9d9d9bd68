"""What pyckpt's framework saves (pyckpt/deepspeed/integrations/: staged_folders.py, accelerate_save.py) keep
and replace in a folder, against stock transformers 5.22 and accelerate 1.15 on the same layouts: stock, run on CPU in one
process without DeepSpeed (tests/workers/framework_stock_worker.py: ``Trainer._save_checkpoint``,
``Accelerator.save_state``), is the oracle for what a checkpoint folder's publication (``into_place``, the
check at the save's start) and accelerate's rotation leave. The part of stock these rules mirror (where the
folder goes, what is written into what exists, which entries the rotation removes) is the same code with or
without DeepSpeed; the saves through DeepSpeed themselves are test_enable_save.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyckpt.deepspeed.integrations import accelerate_save, staged_folders

WORKER = Path(__file__).resolve().parents[2] / "workers" / "framework_stock_worker.py"

# Trainer cases: what is at <run>/checkpoint-3 before the save of step 3. "older" and "older+" copy stock's own
# checkpoint-3 (case "absent") first: a step saved again, "older+" with a file the new save does not write (an
# earlier run's rank 1).
TRAINER = {
    "absent": [],
    "user folder": [("checkpoint-3/notes.txt", "mine"), ("checkpoint-3/sub/more.txt", "mine too")],
    "older": [],
    "older+": [("checkpoint-3/rng_state_1.pth", "an earlier run's rank 1")],
    "file": [("checkpoint-3", "a file of the user's")],
}
# accelerate's save_state(output_dir=<root>/mine)
ACCELERATE_DIR = {
    "absent": [],
    "user folder": [("mine/notes.txt", "mine"), ("mine/sub/more.txt", "mine too")],
    "file": [("mine", "a file of the user's")],
}
# accelerate's automatic naming: (total_limit, what is in checkpoints/ before the save of checkpoint_10);
# a name ending in "/" is a folder (holding one file), "->" a link to a folder outside
ROTATION = {
    "three checkpoints": (2, ["checkpoint_0/", "checkpoint_1/", "checkpoint_2/"]),
    "notes": (2, ["checkpoint_0/", "checkpoint_1/", "notes/"]),
    "best_model": (2, ["checkpoint_0/", "best_model/"]),
    "a file without a number": (2, ["checkpoint_0/", "checkpoint_1/", "notes.txt"]),
    "notes, room left": (3, ["checkpoint_0/", "notes/"]),
    "hidden numbered folder": (2, ["checkpoint_0/", "checkpoint_1/", ".cache7/"]),
    "numbered file among the oldest": (2, ["checkpoint_0/", "run_1.txt", "checkpoint_5/"]),
    "link among the oldest": (1, ["checkpoint_3->", "checkpoint_4/"]),
    "numbered folder of the user's": (2, ["best_model_9/", "checkpoint_0/", "checkpoint_1/"]),
    "no limit": (None, ["checkpoint_0/", "notes/", "checkpoint_1/"]),
}


def _build(root: Path, entries) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in entries:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _build_rotation(root: Path, names) -> None:
    parent = root / "checkpoints"
    parent.mkdir(parents=True)
    for name in names:
        if name.endswith("->"):
            outside = root / ("outside-" + name[:-2])
            _build(outside, [("keep.txt", "outside")])
            os.symlink(outside, parent / name[:-2])
        elif name.endswith("/"):
            _build(parent / name[:-1], [("keep.txt", name)])
        else:
            (parent / name).write_text(name)


def _tree(root: Path) -> dict:
    """relative path -> bytes (a file), "link -> target" or None (a folder), links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = None
            else:
                out[rel] = path.read_bytes()
    return out


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """Stock's saves on every layout: (root of its folders, id -> [exception class name or None, message])."""
    root = tmp_path_factory.mktemp("stock")
    cases = []
    for name, entries in TRAINER.items():
        case = {"id": f"trainer/{name}", "kind": "trainer", "root": str(root / "trainer" / name)}
        (root / "trainer" / name).mkdir(parents=True)
        if name.startswith("older"):  # built by the worker, after the case "absent" saved
            case.update(copy=[str(root / "trainer" / "absent" / "checkpoint-3"),
                              str(root / "trainer" / name / "checkpoint-3")], files=entries)
        else:
            _build(root / "trainer" / name, entries)
        cases.append(case)
    _build(root / "trainer-link-target", [("notes.txt", "mine")])
    (root / "trainer" / "link").mkdir()
    os.symlink(root / "trainer-link-target", root / "trainer" / "link" / "checkpoint-3")
    cases.append({"id": "trainer/link", "kind": "trainer", "root": str(root / "trainer" / "link")})
    for name, entries in ACCELERATE_DIR.items():
        _build(root / "dir" / name, entries)
        cases.append({"id": f"dir/{name}", "kind": "accelerate_dir", "root": str(root / "dir" / name), "name": "mine"})
    for name, (limit, names) in ROTATION.items():
        _build_rotation(root / "rotation" / name, names)
        cases.append({"id": f"rotation/{name}", "kind": "accelerate_rotation", "root": str(root / "rotation" / name),
                      "limit": limit})
    (root / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(WORKER), str(root / "cases.json"), str(root / "result.json")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, json.loads((root / "result.json").read_text())


def _publish(reference: Path, final: Path) -> None:
    """pyckpt's publication of a save at ``final``: the save's files staged beside it (stock's own, saved into
    an empty folder), then put into place; the staging folder removed after, as PendingFolder removes it."""
    staging = final.parent / f".{final.name}.pyckpt-test"
    shutil.copytree(reference, staging / final.name)
    try:
        staged_folders.into_place(str(staging / final.name), str(final))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _same_as_stock(stock_root: Path, results: dict, case: str, run: Path, final: Path, reference: Path) -> None:
    """pyckpt's publication at ``final`` in ``run`` leaves what stock's save left in its copy of the layout: the
    same paths, every file not of the checkpoint byte for byte as before; where stock raised, the same
    exception and nothing changed."""
    before = _tree(run)
    error = results[case][0]
    if error is not None:
        with pytest.raises(FileExistsError, match=final.name):
            _publish(reference, final)
        assert error == "FileExistsError" and _tree(run) == before  # stock failed there too, and kept it
        return
    _publish(reference, final)
    mine, theirs = _tree(run), _tree(stock_root / case)
    assert sorted(mine) == sorted(theirs)
    written = {str(Path(final.name) / rel) for rel in _tree(reference)}
    for rel, content in before.items():
        if rel not in written:  # the user's, or an earlier save's the new one does not write
            assert mine[rel] == theirs[rel] == content, rel


@pytest.mark.parametrize("name", list(TRAINER))
def test_a_trainer_checkpoint_folder_keeps_and_replaces_what_stock_does(stock, tmp_path, name):
    """checkpoint-3 published over what is at that name: a user's folder keeps its files beside the checkpoint's,
    an older save of the same step is replaced whole (one exchange), an earlier save's file the new one does not
    write stays, a file of that name stops the save with FileExistsError and is kept: each as stock's save into
    that layout leaves it."""
    root, results = stock
    run = tmp_path / "run"
    run.mkdir()
    if name.startswith("older"):
        shutil.copytree(root / "trainer" / "absent" / "checkpoint-3", run / "checkpoint-3")
    _build(run, TRAINER[name])
    _same_as_stock(root, results, f"trainer/{name}", run, run / "checkpoint-3",
                   root / "trainer" / "absent" / "checkpoint-3")


def test_a_link_named_like_the_checkpoint_is_refused_where_stock_writes_through_it(stock, tmp_path):
    """The one departure from stock: a link at checkpoint-3 (to a folder of the user's) takes stock's files in its
    target; pyckpt writes through no link, so the save stops there, link and target unchanged."""
    root, results = stock
    assert results["trainer/link"][0] is None
    assert (root / "trainer-link-target" / "notes.txt").is_file()
    assert (root / "trainer-link-target" / "trainer_state.json").is_file()  # stock wrote into the target
    target = tmp_path / "target"
    _build(target, [("notes.txt", "mine")])
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / "checkpoint-3")
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match="link"):
        staged_folders.check_target(str(run / "checkpoint-3"))
    with pytest.raises(FileExistsError, match="link"):
        _publish(root / "trainer" / "absent" / "checkpoint-3", run / "checkpoint-3")
    assert _tree(tmp_path) == before


def test_a_file_where_the_checkpoint_goes_stops_the_save_before_it_writes(tmp_path):
    """The check at the save's start (every process raises it before anything is written: test_enable_save's
    extras show it in a run): a file or a link at the checkpoint's name; a folder or nothing passes."""
    (tmp_path / "file").write_text("mine")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "folder").mkdir()
    for name in ("file", "dangling"):
        with pytest.raises(FileExistsError, match=name):
            staged_folders.check_target(str(tmp_path / name))
    staged_folders.check_target(str(tmp_path / "folder"))
    staged_folders.check_target(str(tmp_path / "absent"))
    assert (tmp_path / "file").read_text() == "mine" and os.path.islink(tmp_path / "dangling")


@pytest.mark.parametrize("name", list(ACCELERATE_DIR))
def test_accelerate_save_state_into_a_folder_keeps_what_stock_keeps(stock, tmp_path, name):
    """save_state(output_dir) where output_dir is a folder of the user's: its files stay beside accelerate's, as
    stock writes beside them; a file at that name stops the save (FileExistsError) and is kept."""
    root, results = stock
    run = tmp_path / "run"
    _build(run, ACCELERATE_DIR[name])
    run.mkdir(exist_ok=True)
    _same_as_stock(root, results, f"dir/{name}", run, run / "mine", root / "dir" / "absent" / "mine")


@pytest.mark.parametrize("name", list(ROTATION))
def test_accelerate_rotation_removes_what_stock_removes(stock, tmp_path, name):
    """accelerate's automatic naming with total_limit: the entries of checkpoints/ pyckpt removes (after the new
    checkpoint_10 is in place) are those stock's save_state removes before writing it; where stock's rotation
    fails (an entry whose name has no number: IndexError, nothing removed; a file or a link among the oldest:
    rmtree's error) pyckpt raises the same exception before removing anything."""
    root, results = stock
    limit, names = ROTATION[name]
    _build_rotation(tmp_path, names)
    parent = tmp_path / "checkpoints"
    before = _tree(tmp_path)
    error = results[f"rotation/{name}"][0]
    theirs = sorted(p.name for p in (root / "rotation" / name / "checkpoints").iterdir() if p.name != "checkpoint_10")
    if error is not None:
        with pytest.raises(Exception) as raised:
            accelerate_save.rotation_victims(str(parent), limit)
        assert type(raised.value).__name__ == error and str(parent) in str(raised.value)
        assert _tree(tmp_path) == before  # nothing removed (stock may have removed the entries sorted before)
        return
    victims = accelerate_save.rotation_victims(str(parent), limit)
    assert _tree(tmp_path) == before  # chosen, not removed: that happens once the new folder is in place
    assert sorted(set(os.listdir(parent)) - {os.path.basename(v) for v in victims}) == theirs

"""A framework's checkpoint folder staged and renamed into place (pyckpt/deepspeed/integrations/staged_folders.py),
without a training job: what the next save cleans and what it leaves, the rename over an existing folder, and a pending
folder published only when DeepSpeed's files and the framework's own background write both succeeded. The
Trainer, accelerate and Lightning runs are in test_enable_save.py."""

from __future__ import annotations

import os
import threading

import pytest

from pyckpt.deepspeed.integrations.staged_folders import PendingFolder, clean_staging, into_place, join_pending

SUFFIX = ".pyckpt-trainer"


def _folder(path, files=("a",)):
    os.makedirs(path, exist_ok=True)
    for name in files:
        with open(os.path.join(path, name), "w") as f:
            f.write(name)
    return path


def test_the_next_save_removes_only_what_a_killed_save_left(tmp_path):
    run = str(tmp_path)
    left = _folder(os.path.join(run, ".checkpoint-4" + SUFFIX, "checkpoint-4"))
    mine = _folder(os.path.join(run, ".checkpoint-6" + SUFFIX))  # this save's own
    users = [_folder(os.path.join(run, name)) for name in ("checkpoint-2", ".cache", "notes" + SUFFIX)]
    with open(os.path.join(run, ".checkpoint-9" + SUFFIX), "w") as f:  # a file of that name: not a staging folder
        f.write("user's")
    outside = _folder(str(tmp_path.parent / (tmp_path.name + "-outside")))
    os.symlink(outside, os.path.join(run, ".checkpoint-8" + SUFFIX))  # a link: never followed nor removed
    clean_staging(run, SUFFIX, keep=mine)
    assert not os.path.exists(os.path.dirname(left))
    assert os.path.isdir(mine) and all(os.path.isdir(u) for u in users)
    assert os.path.isfile(os.path.join(run, ".checkpoint-9" + SUFFIX))
    assert os.path.islink(os.path.join(run, ".checkpoint-8" + SUFFIX)) and os.listdir(outside) == ["a"]


def test_a_folder_goes_into_place_in_one_step_over_an_older_one(tmp_path):
    staged = _folder(str(tmp_path / "stage" / "checkpoint-4"), ("a", "b"))
    final = str(tmp_path / "checkpoint-4")
    into_place(staged, final)
    assert sorted(os.listdir(final)) == ["a", "b"] and not os.path.exists(staged)
    old = os.stat(os.path.join(final, "a")).st_ino
    again = _folder(str(tmp_path / "stage" / "checkpoint-4"), ("a", "b", "c"))
    into_place(again, final)  # a step saved twice, every old file written again: exchanged, the old one removed after
    assert sorted(os.listdir(final)) == ["a", "b", "c"] and not os.path.exists(again)
    assert os.stat(os.path.join(final, "a")).st_ino != old


def test_a_folder_holding_files_the_save_does_not_write_keeps_them(tmp_path):
    """Stock writes a checkpoint file by file into a folder that exists (test_framework_against_stock.py): what it
    does not overwrite stays, and pyckpt moves its files in beside them; a conflict it would fail on too (a
    folder where a file goes, a link) stops the publication before anything moves."""
    final = _folder(str(tmp_path / "checkpoint-4"), ("notes.txt", "a"))
    _folder(os.path.join(final, "global_step4"), ("mine",))
    staged = _folder(str(tmp_path / "stage" / "checkpoint-4"), ("a", "latest"))
    _folder(os.path.join(staged, "global_step4"), ("shard",))
    into_place(staged, final)
    assert sorted(os.listdir(final)) == ["a", "global_step4", "latest", "notes.txt"]
    assert sorted(os.listdir(os.path.join(final, "global_step4"))) == ["mine", "shard"]
    with open(os.path.join(final, "notes.txt")) as f:
        assert f.read() == "notes.txt"
    staged = _folder(str(tmp_path / "stage2" / "checkpoint-4"), ("b",))
    _folder(os.path.join(staged, "notes.txt"))  # a folder where the user's file is
    with pytest.raises(FileExistsError, match="notes.txt"):
        into_place(staged, final)
    assert sorted(os.listdir(final)) == ["a", "global_step4", "latest", "notes.txt"]  # nothing moved, not even b


class _Handle:
    def __init__(self, ok=True, message=None):
        self.ok, self.message = ok, message
        self.done = threading.Event()

    def outcome(self):
        self.done.wait(10)
        return self.ok, self.message


def _pending(tmp_path, handle, write=None):
    staging_run = str(tmp_path / (".checkpoint-4" + SUFFIX))
    staged = _folder(os.path.join(staging_run, "checkpoint-4"))
    final = str(tmp_path / "checkpoint-4")
    seen = []
    owner = object()
    folder = PendingFolder(owner, staged, staging_run, final, handle, lambda: seen.append(os.path.isdir(final)),
                           write)
    return folder, owner, staging_run, final, seen


def test_a_pending_folder_is_published_after_both_writes_then_rotated(tmp_path):
    handle = _Handle()
    order = []
    folder, owner, staging_run, final, seen = _pending(tmp_path, handle, lambda: order.append("model files"))
    folder.start()
    assert not os.path.exists(final)  # DeepSpeed's files still being written
    handle.done.set()
    join_pending(owner)
    assert order == ["model files"] and os.listdir(final) == ["a"] and not os.path.exists(staging_run)
    assert seen == [True]  # the rotation ran after the rename


@pytest.mark.parametrize("failing", ["model files", "deepspeed"])
def test_a_pending_folder_with_a_failed_write_is_never_published(tmp_path, failing, caplog):
    handle = _Handle(ok=failing != "deepspeed", message="disk full" if failing == "deepspeed" else None)

    def write():
        if failing == "model files":
            raise OSError("no space left for model.safetensors")
    folder, owner, staging_run, final, seen = _pending(tmp_path, handle, write)
    folder.start()
    handle.done.set()
    if failing == "model files":
        with pytest.raises(OSError, match="model.safetensors"):
            join_pending(owner)
    else:
        join_pending(owner)
        assert "was not published" in caplog.text and "disk full" in caplog.text
    assert not os.path.exists(final) and not os.path.exists(staging_run) and seen == []
    join_pending(owner)  # reported once


def test_a_held_on_save_and_push_run_once_the_folder_is_in_place_in_stocks_order(tmp_path):
    """What the Trainer runs right after a save (pyckpt/deepspeed/integrations/trainer_after_save.py), one process:
    the on_save that follows an asynchronous save is held (should_save cleared now), nothing runs while the folder is being
    written, then the push and on_save run in that order with the state as it was at the save, leaving the next
    save's should_save alone; a folder that was not published gets neither (test_enable_save.py runs the real
    Trainer)."""
    import types

    from transformers.trainer_callback import CallbackHandler, TrainerCallback, TrainerControl, TrainerState

    from pyckpt.deepspeed.integrations import trainer_after_save as after

    order = []

    class Reader(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            order.append(("on_save", state.global_step, os.path.isdir(str(tmp_path / "checkpoint-4"))))
            control.should_training_stop = True

    trainer = types.SimpleNamespace(args=types.SimpleNamespace(process_index=0), state=TrainerState(global_step=4),
                                    control=TrainerControl(should_save=True))
    trainer.callback_handler = CallbackHandler([Reader()], None, None, None, None)
    handle = _Handle()
    folder, _, _, final, _ = _pending(tmp_path, handle)
    folder.start()
    after.record(trainer, final, folder, lambda path: order.append(("push", trainer.state.global_step,
                                                                      os.path.isdir(path))), defer_on_save=True)
    on_save = after.on_save_stand_in(trainer, trainer.callback_handler.on_save)
    trainer.control = on_save(trainer.args, trainer.state, trainer.control)
    after.settle(trainer)
    assert order == [] and not trainer.control.should_save and not trainer.control.should_training_stop
    trainer.state.global_step = 5  # training goes on
    after.run(trainer, wait=False)
    assert order == []  # still being written
    handle.done.set()
    folder.thread.join()
    trainer.control.should_save = True  # as at the start of the next save, which runs what is held first
    after.run(trainer, wait=True)
    assert order == [("push", 4, True), ("on_save", 4, True)] and trainer.state.global_step == 5
    assert trainer.control.should_training_stop  # what on_save set acts now
    assert trainer.control.should_save  # the next save's own flag (in its trainer_state.json) left as it was
    failed = _Handle(ok=False, message="disk full")
    folder, _, _, final, _ = _pending(tmp_path / "again", failed)
    failed.done.set()
    folder.start()
    after.record(trainer, final, folder, lambda path: order.append("pushed anyway"), defer_on_save=True)
    after.on_save_stand_in(trainer, trainer.callback_handler.on_save)(trainer.args, trainer.state, trainer.control)
    after.run(trainer, wait=True)
    assert len(order) == 2 and not after.queue(trainer)

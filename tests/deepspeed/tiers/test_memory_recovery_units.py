"""The memory tier's multi-node rules without DeepSpeed: the node manifest (whole or not, hostile
contents), which save is recoverable from what the live nodes hold (newest complete one, never two
saves mixed), who sends what to whom, the nodes' layout, and the replica retention."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from types import SimpleNamespace

import pytest

from memory_shares import RUN, describe, model_states

from pyckpt.deepspeed.tiers import job_identity as ji
from pyckpt.deepspeed.tiers import node_manifest as nm
from pyckpt.deepspeed.tiers.nodes import layout, replica_target
from pyckpt.deepspeed.tiers.resume_choice import Holding, inventory, recoverable

MODEL = "ab" * 32
SAVE_DIR = "/work/save"  # the save dir the shares below record


def share(folder, tag, step, node, nodes=2, save="save-1", job="job", files=None, world=4, run=RUN,
          save_dir=SAVE_DIR, states_step=None):
    """A node share as a leader publishes it: files and the manifest listing them; node 0's holds the
    model-state file of mp rank 0, recording ``states_step`` (default: ``step``)."""
    path = os.path.join(folder, tag)
    os.makedirs(path)
    files = files or {f"zero_pp_rank_{2 * node}_mp_rank_00_optim_states.pt": 10 + node,
                      f"zero_pp_rank_{2 * node + 1}_mp_rank_00_optim_states.pt": 20}
    for name, size in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x" * size)
    if node == 0:
        model_states(os.path.join(path, "mp_rank_00_model_states.pt"), step if states_step is None else states_step)
    describe(path, save=save, job=job, step=step, node=node, nodes=nodes, world=world, ranks=(2 * node, 2),
             model=MODEL, run=run, save_dir=save_dir)
    return path


IDENTITY = ji.Identity("job", SAVE_DIR, False)


def test_a_share_counts_only_whole_and_named_for_its_folder(tmp_path):
    path = share(str(tmp_path), "s3", 3, 0)
    m = nm.read(path)
    assert m is not None and (m.step, m.node, m.nodes, m.tag) == (3, 0, 2, "s3")
    assert (m.run, m.save_dir) == (RUN, SAVE_DIR)
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with open(os.path.join(path, name), "ab") as f:  # a file of another size: not whole
        f.write(b"y")
    assert nm.read(path) is None
    os.truncate(os.path.join(path, name), 10)
    assert nm.read(path) is not None
    os.unlink(os.path.join(path, name))
    os.symlink("/etc/passwd", os.path.join(path, name))  # a link where a file was: not followed
    assert nm.read(path) is None
    os.rename(path, os.path.join(str(tmp_path), "s4"))  # a manifest naming another folder
    assert nm.read(os.path.join(str(tmp_path), "s4")) is None


BASE = {"pyckpt_node_manifest": 2, "save": "a", "job": "j", "tag": "t", "step": 1, "node": 0, "nodes": 1,
        "world_size": 1, "ranks": [0, 1], "model": MODEL, "files": [["f", 1, 7]], "run": RUN, "save_dir": SAVE_DIR}


@pytest.mark.parametrize("change", [
    {"pyckpt_node_manifest": 1}, {"save": "../x"}, {"job": ".hidden"}, {"tag": "a/b"}, {"step": -1},
    {"step": True}, {"node": 1}, {"nodes": 0}, {"world_size": 0}, {"ranks": [0, 2]}, {"ranks": [0]},
    {"model": "zz"}, {"files": []}, {"files": [["../etc/passwd", 1, 7]]}, {"files": [["/abs", 1, 7]]},
    {"files": [["a//b", 1, 7]]}, {"files": [["f", 1, 7], ["f", 2, 7]]}, {"files": [["f", -1, 7]]},
    {"files": [["f\x1b", 1, 7]]}, {"files": [[nm.NAME, 1, 7]]}, {"files": [["f", 2 ** 63, 7]]}, {"step": 1.5},
    {"files": [["f", 1]]}, {"files": [["f", 1, 2 ** 32]]}, {"files": [["f", 1, -1]]}, {"files": [["f", 1, True]]},
    {"run": "x" * 32}, {"run": None}, {"save_dir": "relative/dir"}, {"save_dir": "/a\nb"}, {"save_dir": 7},
], ids=lambda c: "-".join(f"{k}={v!r}" for k, v in c.items())[:60])
def test_a_hostile_manifest_is_refused_naming_the_field(tmp_path, change):
    with pytest.raises(nm.CheckpointFormatError):
        nm.parse({**BASE, **change}, "m.json")
    assert nm.parse(BASE, "m.json").files == (("f", 1, 7), )


@pytest.mark.parametrize("tag", ["step 1", "é" * 64, "run-3+b", "s" * 128])
def test_a_manifest_records_every_tag_the_save_takes(tag):
    """The manifest's tag follows the save's tag rule: a memory checkpoint saved under a tag the save
    took is one a recovery can read back."""
    from pyckpt.deepspeed.save.request import check_tag

    assert check_tag(tag) == tag
    assert nm.parse({**BASE, "tag": tag}, "m.json").tag == tag
    assert nm.parse(json.loads(nm.parse({**BASE, "tag": tag}, "m.json").to_json()), "m.json").tag == tag


@pytest.mark.parametrize("job", ["x" * 128, "A-z_0.9"])
def test_a_manifest_records_every_job_name_the_root_takes(job):
    assert nm.parse({**BASE, "job": job}, "m.json").job == job
    with pytest.raises(nm.CheckpointFormatError, match="job 'j b' must be one folder name"):
        nm.parse({**BASE, "job": "j b"}, "m.json")


def test_the_manifest_file_itself_is_read_strictly(tmp_path):
    path = tmp_path / "t"
    path.mkdir()
    (path / "f").write_bytes(b"x")
    (path / nm.NAME).write_text(json.dumps(BASE).replace('"step": 1', '"step": 1, "step": 2'))
    assert nm.read(str(path)) is None  # duplicate keys
    (path / nm.NAME).write_text(json.dumps(BASE))
    assert nm.read(str(path)) is not None


def held(node, *items):
    return [Holding(("save-%s" % save, "job", f"s{step}", step, nodes, 4, MODEL), origin, step, f"s{step}", nodes, 4,
                    f"/n{node}/{save}/{origin}", origin == 0, RUN) for save, step, origin, nodes in items]


def test_the_newest_save_every_share_of_which_a_live_node_holds_wins():
    # step 5: node 0's own share, node 1's share lost with node 1 and its replica never arrived;
    # step 4: node 0's own and node 1's replica on node 0: recoverable
    live = {0: held(0, ("b", 5, 0, 2), ("a", 4, 0, 2), ("a", 4, 1, 2))}
    plan = recoverable(live)
    assert plan.step == 4 and plan.holders == {0: (0, ), 1: (0, )}
    assert plan.story(1) == "node 1's files from the copy on node 0"
    # a second save of step 4 (a rerun) with only one share never mixes with the first
    live[0] += held(0, ("c", 4, 1, 2))
    assert recoverable(live).key[0] == "save-a"
    assert recoverable({0: held(0, ("b", 5, 0, 2))}) is None


def test_a_node_that_lacks_a_share_gets_it_from_the_holders_in_turn():
    live = {0: held(0, ("a", 7, 0, 3), ("a", 7, 2, 3)), 1: held(1, ("a", 7, 1, 3), ("a", 7, 0, 3)),
            2: held(2, ("a", 7, 2, 3), ("a", 7, 1, 3))}
    plan = recoverable(live)
    fetches = plan.fetches(3)
    assert sorted((o, to) for _, o, to in fetches) == [(0, 2), (1, 0), (2, 1)]
    assert all(h in plan.holders[o] for h, o, _ in fetches)
    assert plan.fetches(4)  # a fourth, empty node gets all three
    assert sorted(o for _, o, to in plan.fetches(4) if to == 3) == [0, 1, 2]


def test_inventory_finds_own_shares_replicas_and_a_former_node_number(tmp_path):
    root = tmp_path / "root"
    node0 = root / "job" / "node0"
    node1 = root / "job" / "node1"  # this host was node 1 in the run before
    for p in (root, root / "job", node0, node1):
        p.mkdir(mode=0o700)
    share(str(node1), "s2", 2, 1)
    replicas = node1 / "replica-of-node0"
    replicas.mkdir(mode=0o700)
    share(str(replicas), "s2", 2, 0)
    share(str(node0), "junk", 9, 0, job="other")  # another job's share: not this job's
    share(str(node0), "elsewhere", 8, 0, save_dir="/another/save")  # another save dir's: not this job's
    found = inventory(str(root), IDENTITY)
    assert sorted((h.origin, h.step) for h in found) == [(0, 2), (1, 2)]
    assert recoverable({0: found}).step == 2


def test_layout_leaders_and_ring():
    assert layout([0, 0, 1, 1]) == ([0, 2], [(0, 2), (2, 2)])
    with pytest.raises(ValueError, match="not one contiguous block"):
        layout([0, 1, 0, 1])
    with pytest.raises(ValueError, match="not 0 to"):
        layout([0, 0, 2, 2])
    assert [replica_target(n, 3) for n in range(3)] == [1, 2, 0] and replica_target(0, 1) is None


def test_replica_retention_keeps_the_newest_of_this_job_and_model(tmp_path):
    folder = str(tmp_path)
    for step in (1, 2, 3):
        share(folder, f"s{step}", step, 0)
    share(folder, "other", 0, 0, job="someone-else")
    share(folder, "run0", 0, 0, run="f" * 32)  # an earlier run's of the same save dir
    os.mkdir(os.path.join(folder, "user-folder"))
    removed = nm.prune(folder, 2, lambda m: ji.owns(m, IDENTITY, RUN), MODEL)
    assert [os.path.basename(p) for p in removed] == ["s1"]
    assert sorted(os.listdir(folder)) == ["other", "run0", "s2", "s3", "user-folder"]


def test_reserved_tags():
    assert nm.tag_reserved("restore") and nm.tag_reserved("replica-of-node3") and not nm.tag_reserved("s1")


def test_a_former_node_number_s_folder_goes_once_this_node_holds_keep_newer_shares(tmp_path):
    """A host that was node 1 before a restart and is node 0 now: its old node1/ folder (shares and
    replicas of the earlier run) stays while it may be the newest copy left, and goes once this node's
    own folder holds `keep` shares at least as new; a folder with a newer share stays."""
    from types import SimpleNamespace

    from pyckpt.deepspeed.save.node_share import NodeShare

    root = tmp_path / "root"
    job = root / "job"
    for p in (root, job, job / "node0", job / "node1", job / "node2"):
        p.mkdir(mode=0o700)
    share(str(job / "node1"), "s3", 3, 1)
    (job / "node1" / "replica-of-node0").mkdir(mode=0o700)
    share(str(job / "node1" / "replica-of-node0"), "s3", 3, 0)
    share(str(job / "node2"), "s9", 9, 1)  # newer than anything this node will hold below: kept
    links = SimpleNamespace(node=0, count=2, leader=True, ranks=[(0, 2), (2, 2)], sender=None)
    mine = NodeShare(links, IDENTITY, RUN, MODEL, keep=2, root=str(root), world_size=4)
    share(str(job / "node0"), "s4", 4, 0)
    mine._prune_stale(str(job / "node0"))
    assert sorted(os.listdir(job)) == ["node0", "node1", "node2"]  # one share of its own: not yet
    share(str(job / "node0"), "s5", 5, 0)
    mine._prune_stale(str(job / "node0"))
    assert sorted(os.listdir(job)) == ["node0", "node2"]


def test_a_share_whose_file_path_leads_out_through_a_folder_link_does_not_count(tmp_path):
    path = tmp_path / "t"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_bytes(b"x")
    path.mkdir(mode=0o700)
    os.symlink(str(tmp_path / "elsewhere"), path / "sub")
    nm.write(str(path), nm.NodeManifest("a", "j", "t", 1, 0, 1, 1, (0, 1), MODEL, (("sub/f", 1, 0), ), RUN, SAVE_DIR))
    assert nm.read(str(path)) is None
    os.unlink(path / "sub")
    (path / "sub").mkdir()
    (path / "sub" / "f").write_bytes(b"x")
    assert nm.read(str(path)) is not None


def test_a_memory_save_replaces_only_its_own_job_s_share_never_a_user_s_folder_named_like_the_tag(tmp_path):
    from types import SimpleNamespace

    from pyckpt.deepspeed.save.node_share import NodeShare

    links = SimpleNamespace(node=0, count=1, leader=True, ranks=[(0, 1)], sender=None)
    mine = NodeShare(links, IDENTITY, RUN, MODEL, keep=2, root=str(tmp_path), world_size=1)
    user = tmp_path / "s7"
    user.mkdir()
    (user / "mp_rank_00_model_states.pt").write_bytes(b"the user's own")
    problem = mine.replace_problem(str(user))
    assert problem and "is not a memory checkpoint of job job" in problem
    share(str(tmp_path), "s8", 8, 0, nodes=1, job="another-job")
    assert "is not a memory checkpoint of job job" in mine.replace_problem(str(tmp_path / "s8"))
    share(str(tmp_path), "s6", 6, 0, nodes=1, save_dir="/another/save")  # the same name, another save dir's
    assert "is not a memory checkpoint of job job" in mine.replace_problem(str(tmp_path / "s6"))
    share(str(tmp_path), "s9", 9, 0, nodes=1)
    assert mine.replace_problem(str(tmp_path / "s9")) is None and mine.replace_problem(str(tmp_path / "s10")) is None
    assert (user / "mp_rank_00_model_states.pt").read_bytes() == b"the user's own"


SCALE = r"""
import os, resource, sys, time
from pyckpt.deepspeed.load import memory_recovery
from pyckpt.deepspeed.tiers import node_manifest as nm
from pyckpt.deepspeed.tiers.policy import MemoryTier
from pyckpt.deepspeed.tiers.job_identity import Identity
from pyckpt.deepspeed.tiers.resume_choice import inventory, recoverable
root, count = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
node = os.path.join(root, "job", "node0")
tag = os.path.join(node, "s1")
t0 = time.perf_counter()
files = tuple(nm.describe(tag))
run, identity = "ab" * 16, Identity("job", "/save", False)
nm.write(tag, nm.NodeManifest("a", "job", "s1", 1, 0, 1, 1, (0, 1), "ab" * 32, files, run, "/save"))
import dataclasses
held = [dataclasses.replace(h, vouched=True) for h in inventory(root, identity, run)]  # its step: not what is tested
plan = recoverable({0: held})
problem = memory_recovery._assemble(plan, MemoryTier(root=root, job="job"), node, identity, run)
linked = len(os.listdir(os.path.join(node, "restore", "s1")))
print(len(files), len(held), problem, linked, round(time.perf_counter() - t0, 2))
"""


def test_a_share_of_fifteen_thousand_files_is_read_and_linked_under_64_descriptors(tmp_path):
    """A DeepSeek-class MoE's node share holds thousands of expert files: listing, describing,
    recovering and linking it hold a few descriptors at a time, whatever the count."""
    import subprocess
    import sys

    root = tmp_path / "root"
    tag = root / "job" / "node0" / "s1"
    for p in (root, root / "job", root / "job" / "node0"):
        p.mkdir(mode=0o700)
    tag.mkdir(mode=0o700)
    for i in range(15_000):
        (tag / f"layer_{i // 64}_expert_{i % 64}_mp_rank_00_model_states.pt").write_bytes(b"x")
    run = subprocess.run([sys.executable, "-c", SCALE, str(root), "15000"], capture_output=True, text=True, cwd="/",
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    files, held, problem, linked, _ = run.stdout.split()
    assert (files, held, problem, linked) == ("15000", "1", "None", "15000")


# -- what a recovery trusts -------------------------------------------------------------------------

@pytest.fixture
def tier_layout(tmp_path, monkeypatch):
    """One node's tier of job "job" saving to tmp_path/save, recorded as the run's, in tmpfs (/dev/shm)
    where the machine has it; shares added by ``add(step, claims=...)``; save_dir holds a DeepSpeed
    checkpoint at step ``durable`` when asked."""
    import shutil
    import tempfile
    from pathlib import Path

    from memory_shares import claim

    from pyckpt.deepspeed.tiers.links import forget_all
    from pyckpt.deepspeed.tiers.policy import MemoryTier

    for name in ("PYCKPT_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    root = Path(tempfile.mkdtemp(prefix="pyckpt-test-", dir="/dev/shm")) if shm else tmp_path / "mem"
    claim(root, "job", save_dir)
    tier = MemoryTier(root=str(root), job="job")
    node = root / "job" / "node0"

    def add(step, claims=None):
        path = node / f"s{step}"
        path.mkdir()
        model_states(path / "mp_rank_00_model_states.pt", step)
        (path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(5000))
        describe(path, save=f"save-{step}", job="job", step=step if claims is None else claims, save_dir=save_dir)
        return path

    def durable(step):
        model_states_folder = save_dir / f"global_step{step}"
        model_states_folder.mkdir()
        model_states(model_states_folder / "mp_rank_00_model_states.pt", step)
        (save_dir / "latest").write_text(f"global_step{step}")

    try:
        yield SimpleNamespace(tier=tier, node=node, save_dir=save_dir, add=add, durable=durable)
    finally:
        forget_all()
        if shm:
            shutil.rmtree(root)


def _recover(layout):
    from logged import pyckpt_warnings

    from pyckpt.deepspeed.load.memory_recovery import recover

    lines = pyckpt_warnings()
    return recover(layout.tier, str(layout.save_dir)), lines


def test_the_step_a_share_claims_counts_only_where_its_model_state_file_records_it(tier_layout):
    """A share holding step-3 files that claims step 999 does not win over save_dir at step 50: the step
    is read from the model-state file, as on the save_dir side, and the disagreement is said in one line."""
    lie = tier_layout.add(3, claims=999)
    tier_layout.durable(50)
    found, lines = _recover(tier_layout)
    assert found is None
    (line, ) = lines
    assert line.startswith(f"pyckpt: resuming from {tier_layout.save_dir}, not from memory: ") and \
        f"{lie} claims step 999, its model-state file records step 3: not recovered" in line, line
    # and where it claims the step it holds, it is the newest and is taken
    tier_layout.add(60)
    found, lines = _recover(tier_layout)
    assert found == (str(tier_layout.node / "restore"), "s60")
    assert lines[0].startswith("pyckpt: resuming step 60 from memory") and "claims step 999" in lines[0]


def test_a_planted_restore_link_is_refused_and_nothing_is_written_through_it(tier_layout, tmp_path):
    """<node>/restore, where a recovery assembles the checkpoint, is checked as the root is: a link there to a
    folder outside the memory root is refused (the recovery loads save_dir, saying why) and nothing is
    written into the folder it names."""
    tier_layout.add(5)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tier_layout.node / "restore")
    found, lines = _recover(tier_layout)
    assert found is None and os.listdir(outside) == []
    assert os.readlink(tier_layout.node / "restore") == str(outside)
    (line, ) = lines
    assert "step 5 (s5) could not be put together" in line and "the recovery's folder is a symbolic link" in line, \
        line
    # another user's or a group-writable restore folder: refused alike
    os.unlink(tier_layout.node / "restore")
    (tier_layout.node / "restore").mkdir(mode=0o777)
    os.chmod(tier_layout.node / "restore", 0o777)
    found, lines = _recover(tier_layout)
    assert found is None and "writable by group or others" in lines[0]
    assert os.listdir(tier_layout.node / "restore") == []


def test_a_flipped_byte_in_memory_falls_back_to_the_older_step_then_to_save_dir_with_one_line(tier_layout):
    """Each file's CRC-32 is recorded at the save and checked when a recovery reads the files: a byte
    flipped in the newest share since passes it over for the older one; flipped there too, save_dir."""
    older, newer = tier_layout.add(4), tier_layout.add(5)
    manifest = nm.read(str(newer))
    assert {name: crc for name, _, crc in manifest.files} == {
        name: zlib.crc32((newer / name).read_bytes()) for name in os.listdir(newer) if name != nm.NAME}

    def flip(folder):
        path = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        data = bytearray(path.read_bytes())
        data[1234] ^= 0x10
        with open(path, "r+b") as f:  # in place, as memory corruption is: same file, same size
            f.write(data)

    flip(newer)
    found, lines = _recover(tier_layout)
    assert found == (str(tier_layout.node / "restore"), "s4")
    (line, ) = lines
    assert line.startswith("pyckpt: resuming step 4 from memory") and "step 5 (s5) could not be put together" in line
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt of node 0's share of s5: the CRC-32 of its 5000 bytes is" in line
    assert "its memory copy is damaged" in line and line.endswith("passed over"), line
    flip(older)
    tier_layout.durable(2)
    found, lines = _recover(tier_layout)
    assert found is None
    (line, ) = lines
    assert line.startswith(f"pyckpt: resuming from {tier_layout.save_dir}, not from memory: step 5 (s5) could not be "
                           "put together") and "step 4 (s4) could not be put together" in line, line


def test_the_crcs_read_while_the_engine_builds_are_taken_and_a_file_changed_since_is_read_again(tier_layout,
                                                                                                monkeypatch):
    """enable(memory=...) starts reading the node's newest share on its first local rank while the engine
    is built (tiers/prechecked.py): the recovery then reads none of those files again; a file written
    since (a flipped byte: same size, new modification time) is read again, and its damage is found."""
    from pyckpt.deepspeed.tiers import prechecked

    older, newer = tier_layout.add(4), tier_layout.add(5)
    reads = []
    crc_of = nm.file_crc
    monkeypatch.setattr(nm, "file_crc", lambda path, *a, **k: reads.append(os.path.basename(path)) or
                        crc_of(path, *a, **k))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert prechecked.start(tier_layout.tier) is False  # not the node's first local rank
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        assert prechecked.start(tier_layout.tier) is True
        found, _ = _recover(tier_layout)  # waits for the read ahead
        assert found == (str(tier_layout.node / "restore"), "s5")
        names = sorted(n for n in os.listdir(newer) if n != nm.NAME)
        assert sorted(reads) == names  # each read once, ahead; the recovery took them
        reads.clear()
        path = newer / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        data = bytearray(path.read_bytes())
        data[77] ^= 0x01
        with open(path, "r+b") as f:
            f.write(data)
        found, lines = _recover(tier_layout)
        assert found == (str(tier_layout.node / "restore"), "s4")
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt of node 0's share of s5: the CRC-32" in lines[0], lines
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in reads  # read again, not taken
    finally:
        prechecked.forget()


def _replica_share(layout, step):
    """Node 1's share of save ``step``, kept in node 0's folder as its replica."""
    from memory_shares import describe

    path = layout.node / "replica-of-node1" / f"s{step}"
    path.mkdir(parents=True)
    (path / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(os.urandom(7000))
    (path / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(os.urandom(6000))
    describe(path, save=f"save-{step}", job="job", step=step, node=1, nodes=2, world=2, ranks=(1, 1),
             save_dir=layout.save_dir)
    return path


@pytest.mark.parametrize("asked_first", [False, True])
def test_the_read_ahead_takes_the_replicas_too_until_the_recovery_asks_for_other_files(asked_first, tier_layout,
                                                                                        monkeypatch):
    """After the node's own newest share the read ahead reads its newest replica of each other node's share
    (what a recovery after that node's loss puts together here); once the recovery has asked for its files,
    it reads only those, so a restart that lost no node never waits for replicas."""
    import threading
    import time

    from pyckpt.deepspeed.tiers import prechecked

    own = tier_layout.add(5)
    replica = _replica_share(tier_layout, 5)
    reads = []
    crc_of = nm.file_crc
    monkeypatch.setattr(nm, "file_crc", lambda path, *a, **k: reads.append(os.path.basename(path)) or
                        crc_of(path, *a, **k))
    listed = nm.replica_folders
    asked = threading.Event()

    def replica_folders(folder):  # the recovery asks while the own share's files are being read
        if asked_first:
            end = time.monotonic() + 60
            while prechecked._wanted is None and time.monotonic() < end:
                time.sleep(0.01)
            asked.set()
        return listed(folder)

    monkeypatch.setattr(nm, "replica_folders", replica_folders)
    monkeypatch.setenv("LOCAL_RANK", "0")
    own_names = sorted(n for n in os.listdir(own) if n != nm.NAME)
    replica_names = sorted(n for n in os.listdir(replica) if n != nm.NAME)
    try:
        assert prechecked.start(tier_layout.tier) is True
        if not asked_first:
            prechecked._thread.join()
        got = prechecked.crcs([(str(own / n), None) for n in own_names])
        assert [c for c, _ in got] == [zlib.crc32((own / n).read_bytes()) for n in own_names]
        assert sorted(reads) == (own_names if asked_first else sorted(own_names + replica_names))
        assert asked.is_set() == asked_first
        reads.clear()
        got = prechecked.crcs([(str(replica / n), None) for n in replica_names])
        assert [c for c, _ in got] == [zlib.crc32((replica / n).read_bytes()) for n in replica_names]
        assert sorted(reads) == ([] if not asked_first else replica_names)  # taken from the read ahead, or read now
    finally:
        prechecked.forget()


@pytest.mark.parametrize("replica", [False, True])
def test_the_read_ahead_reads_no_file_a_folder_link_in_a_share_leads_to(replica, tier_layout, tmp_path, monkeypatch):
    """A share whose manifest names a file through a folder link leading out of it is not read ahead (the
    manifest's own rule refuses the share), nor is any file outside the node's folder; a replica's too."""
    from pyckpt.deepspeed.tiers import prechecked

    share = tier_layout.add(7)
    if replica:  # the node's own share is fine; the replica read after it holds the link
        share = _replica_share(tier_layout, 7)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "f").write_bytes(b"secret")
    os.symlink(outside, share / "sub")
    manifest = nm.read(str(share))
    os.unlink(share / nm.NAME)
    nm.write(str(share), dataclasses.replace(manifest, files=manifest.files + (("sub/f", 6, zlib.crc32(b"secret")), )))
    opened = []
    crc_of = nm.file_crc
    monkeypatch.setattr(nm, "file_crc", lambda path, *a, **k: opened.append(os.path.realpath(path)) or
                        crc_of(path, *a, **k))
    monkeypatch.setenv("LOCAL_RANK", "0")
    try:
        assert prechecked.start(tier_layout.tier) is True
        prechecked.crcs([])  # waits for the read ahead
        assert nm.read(str(share)) is None
        if replica:  # the own share's files only
            assert opened and all(p.startswith(os.path.realpath(tier_layout.node / "s7")) for p in opened), opened
        else:
            assert opened == []
    finally:
        prechecked.forget()


def test_the_tier_keywords_say_which_tier_and_take_their_former_name(tier_layout, monkeypatch):
    """enable(resume_tier=) is where a resume looks, save_checkpoint(save_tier=) where a save goes; the
    former keyword of both, memory=, is still taken; two different tiers given both ways are refused
    before anything is set or saved."""
    import pyckpt.deepspeed as pd
    from pyckpt.deepspeed.settings import SETTINGS

    tier, other = tier_layout.tier, dataclasses.replace(tier_layout.tier, keep=3)
    monkeypatch.setenv("LOCAL_RANK", "1")  # no read ahead of the node's share: not its first local rank
    with pytest.raises(ValueError, match=r"resume_tier= and memory= \(its former name\) were both given"):
        pd.enable(resume_tier=tier, memory=other)
    assert SETTINGS.resume_tier is None
    for keyword in ("resume_tier", "memory"):
        with pd.enable(**{keyword: tier}):
            assert SETTINGS.resume_tier is tier
        assert SETTINGS.resume_tier is None
    with pytest.raises(ValueError, match=r"save_tier= and memory= \(its former name\) were both given"):
        pd.save_checkpoint(None, str(tier_layout.save_dir), save_tier=tier, memory=other)


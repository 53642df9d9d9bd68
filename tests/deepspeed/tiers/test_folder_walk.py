"""The memory tier's one folder walk (pyckpt.deepspeed.tiers.folder_walk) and the walks built on it: a tag
folder's files (the manifest's list, the replica sender's), a share's files by its manifest, the bytes a
job's tree and the free slot hold. One depth rule (a tag folder nests at most TAG_DEPTH folders, a job's
tree the tier's levels above that), links never followed, anything but files and folders refused by a
checkpoint's walk and passed over by a measure. Fast: no DeepSpeed."""

import json
import os

import pytest

from pyckpt import CheckpointFormatError, MemoryRootError
from pyckpt.deepspeed.tiers import folder_walk as fw
from pyckpt.deepspeed.tiers import free_slot
from pyckpt.deepspeed.tiers import memory_root as mr
from pyckpt.deepspeed.tiers import node_manifest as nm
from pyckpt.deepspeed.tiers.folder_names import LEVELS_ABOVE_TAG

MiB = 1 << 20


def write(path, data=b"x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def nested(top, levels):
    """``top`` holding a file ``levels`` folders down."""
    path = os.path.join(str(top), *[f"d{i}" for i in range(levels)], "f")
    write(path)
    return path


def test_tag_files_lists_every_file_sorted_by_its_whole_name(tmp_path):
    for name in ("b", "a-b", "a/c", "a/z/y", nm.NAME):
        write(tmp_path / "t" / name, name.encode())
    files = fw.tag_files(str(tmp_path / "t"))
    assert [f.name for f in files] == sorted(["b", "a-b", "a/c", "a/z/y", nm.NAME])  # "a-b" before "a/c"
    assert [f.stat.st_size for f in files] == [len(f.name) for f in files]
    assert nm.list_files(str(tmp_path / "t")) == [(n, len(n)) for n in sorted(["b", "a-b", "a/c", "a/z/y"])]


@pytest.mark.parametrize("depth", [fw.TAG_DEPTH, fw.TAG_DEPTH + 1])
def test_one_depth_rule_for_a_tag_folder(tmp_path, depth):
    top = tmp_path / "t"
    nested(top, depth)
    if depth <= fw.TAG_DEPTH:
        assert len(nm.list_files(str(top))) == 1
        return
    with pytest.raises(CheckpointFormatError, match=f"/d{fw.TAG_DEPTH}: is a sub-folder more than {fw.TAG_DEPTH} "
                                                     f"levels down"):
        nm.list_files(str(top))


def test_a_checkpoints_walk_refuses_links_and_special_files_and_follows_none(tmp_path):
    top = tmp_path / "t"
    write(top / "sub" / "f")
    (tmp_path / "outside").mkdir()
    write(tmp_path / "outside" / "secret")
    os.symlink(tmp_path / "outside", top / "sub" / "away")
    with pytest.raises(CheckpointFormatError, match="/sub/away: is a symbolic link; .*links are not followed"):
        fw.tag_files(str(top))
    os.unlink(top / "sub" / "away")
    os.mkfifo(top / "sub" / "fifo")
    with pytest.raises(CheckpointFormatError, match="/sub/fifo: is a FIFO"):
        fw.tag_files(str(top))
    os.unlink(top / "sub" / "fifo")
    os.symlink(top, tmp_path / "top-link")
    with pytest.raises(CheckpointFormatError, match="the tag folder is a symbolic link"):
        fw.tag_files(str(tmp_path / "top-link"))
    assert [f.name for f in fw.tag_files(str(top))] == ["sub/f"]


def test_named_files_finds_a_manifests_files_without_following_a_link_on_the_way(tmp_path):
    top = tmp_path / "t"
    write(top / "a" / "f", b"12")
    write(top / "g", b"3")
    assert [(f.name, f.stat.st_size) for f in fw.named_files(str(top), ["g", "a/f"])] == [("g", 1), ("a/f", 2)]
    os.rename(top / "a", tmp_path / "a-elsewhere")
    os.symlink(tmp_path / "a-elsewhere", top / "a")  # the same file, behind a folder link
    with pytest.raises(CheckpointFormatError, match="/t/a/: is not a real folder inside the tag folder"):
        fw.named_files(str(top), ["g", "a/f"])
    os.symlink(tmp_path / "a-elsewhere" / "f", top / "h")
    with pytest.raises(CheckpointFormatError, match="/t/h: is a symbolic link"):
        fw.named_files(str(top), ["h"])
    with pytest.raises(CheckpointFormatError, match="/t/missing: cannot be found"):
        fw.named_files(str(top), ["missing"])
    deep = "/".join(["d"] * (fw.TAG_DEPTH + 1) + ["f"])
    with pytest.raises(CheckpointFormatError, match="is a sub-folder more than"):
        fw.named_files(str(top), [deep])


def _share(folder, files):
    for name, data in files.items():
        write(os.path.join(folder, name), data)
    os.chmod(folder, 0o700)
    listed = [[name, len(data), 0] for name, data in sorted(files.items())]
    body = {"pyckpt_node_manifest": nm.VERSION, "save": "s", "job": "j", "tag": os.path.basename(folder), "step": 1,
            "node": 0, "nodes": 1, "world_size": 1, "ranks": [0, 1], "model": "0" * 64, "files": listed,
            "run": "ab" * 16, "save_dir": "/ckpt"}
    with open(os.path.join(folder, nm.NAME), "w") as f:
        json.dump(body, f)


def test_share_files_go_by_the_manifest(tmp_path):
    share = str(tmp_path / "global_step1")
    _share(share, {"a": b"1", "sub/b": b"22"})
    assert nm.read(share) is not None
    write(os.path.join(share, "not-listed"))  # written after the save: not the share's
    assert [(f.name, f.stat.st_size) for f in nm.share_files(share)] == [("a", 1), ("sub/b", 2)]
    os.unlink(os.path.join(share, "a"))
    with pytest.raises(CheckpointFormatError, match="global_step1: not a whole node share"):
        nm.share_files(share)


def test_a_share_whose_manifest_names_a_file_too_deep_is_not_whole(tmp_path):
    share = str(tmp_path / "global_step1")
    deep = "/".join(["d"] * (fw.TAG_DEPTH + 1) + ["f"])
    _share(share, {"a": b"1", deep: b"2"})
    assert nm.read(share) is None


def test_a_measure_counts_files_once_and_passes_over_links_and_special_files(tmp_path):
    top = tmp_path / "t"
    write(top / "a", os.urandom(MiB))
    os.link(top / "a", top / "a-again")
    write(tmp_path / "big", os.urandom(4 * MiB))
    os.symlink(tmp_path / "big", top / "link")
    os.symlink(tmp_path, top / "folder-link")
    os.mkfifo(top / "fifo")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        used = fw.held_bytes(fd, str(top), 1, MemoryRootError, "why")
    finally:
        os.close(fd)
    assert MiB <= used < 2 * MiB


def test_the_free_slot_is_measured_by_the_same_walk(tmp_path):
    node = tmp_path / "node0"
    node.mkdir()
    assert free_slot.size(str(node)) == 0  # no slot
    write(node / free_slot.NAME / "a", os.urandom(MiB))
    os.link(node / free_slot.NAME / "a", node / free_slot.NAME / "b")  # one file's pages, counted once
    assert MiB <= free_slot.size(str(node)) < 2 * MiB
    nested(node / free_slot.NAME, fw.TAG_DEPTH + 1)
    with pytest.raises(CheckpointFormatError, match="the free slot was a tag folder"):
        free_slot.size(str(node))


def test_a_jobs_tree_is_walked_to_its_tag_folders_depth_and_no_deeper(tmp_path):
    root = str(tmp_path / "root")
    node = mr.node_memory_folder(root, "j", 0)
    nested(node, LEVELS_ABOVE_TAG - 1 + fw.TAG_DEPTH)  # node<N> is the first level below the job's folder
    assert mr.budget(root, "j").used > 0
    mr.remove_job(root, "j")
    node = mr.node_memory_folder(root, "j", 0)
    nested(node, LEVELS_ABOVE_TAG + fw.TAG_DEPTH)
    with pytest.raises(MemoryRootError, match="is a sub-folder more than 12 levels down; the job's memory folder "
                                              "nests at most 12 folders"):
        mr.budget(root, "j")
    with pytest.raises(MemoryRootError, match="nests at most 12 folders"):
        mr.remove_job(root, "j")

"""Files a checkpoint folder holds are opened only inside it (pyckpt.formats.confined).

A name is resolved component by component with O_NOFOLLOW; a link is followed only while its
target stays inside the folder; what is opened must be a regular file on a real filesystem.
"""

import os

import pytest

from pyckpt.errors import CheckpointFormatError
from pyckpt.formats.confined import check_links_inside, inside, read_inside, read_small_text


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "ck"
    (root / "sub").mkdir(parents=True)
    (root / "vocab.txt").write_bytes(b"a\nb\n")
    (root / "sub" / "tokenizer.json").write_bytes(b"{}")
    (tmp_path / "secret").write_bytes(b"TOKEN=hunter2")
    return root


def test_a_plain_file_and_links_that_stay_inside_are_read(folder):
    os.symlink("sub/tokenizer.json", folder / "rel")
    os.symlink(str(folder / "vocab.txt"), folder / "abs")  # absolute, beneath the folder
    os.symlink("sub", folder / "dirlink")
    os.symlink("../vocab.txt", folder / "sub" / "up")  # climbs, but not above the folder
    os.symlink("rel", folder / "chain")
    assert read_inside(str(folder), "vocab.txt", 100) == b"a\nb\n"
    assert read_inside(str(folder), "rel", 100) == b"{}"
    assert read_inside(str(folder), "abs", 100) == b"a\nb\n"
    assert read_inside(str(folder), "dirlink/tokenizer.json", 100) == b"{}"
    assert read_inside(str(folder), "sub/up", 100) == b"a\nb\n"
    assert read_inside(str(folder), "chain", 100) == b"{}"
    check_links_inside(str(folder), os.listdir(folder))
    assert inside(str(folder), "chain") == os.path.join(str(folder), "chain")


@pytest.mark.parametrize("target", ["/proc/self/environ", "../secret", "SECRET_ABS", "sub/../../secret",
                                    "/etc/passwd", "dirout/secret"])
def test_a_link_that_leaves_the_folder_is_refused_and_nothing_is_read(folder, target):
    secret = str(folder.parent / "secret")
    if target == "SECRET_ABS":
        target = secret
    if target.startswith("dirout"):
        os.symlink(str(folder.parent), folder / "dirout")
    os.symlink(target, folder / "vocab2.txt")
    with pytest.raises(CheckpointFormatError, match="outside its folder") as ei:
        read_inside(str(folder), "vocab2.txt", 1 << 20)
    message = str(ei.value)
    assert message.startswith(str(folder / "vocab2.txt")) and "\n" not in message
    assert "hunter2" not in message
    with pytest.raises(CheckpointFormatError, match="outside its folder"):
        inside(str(folder), "vocab2.txt")
    with pytest.raises(CheckpointFormatError, match="outside its folder"):
        check_links_inside(str(folder), ["vocab.txt", "vocab2.txt"])


def test_a_link_hop_through_an_inside_link_that_then_leaves_is_refused(folder):
    os.symlink("..", folder / "sub" / "parent")  # folder itself: inside
    os.symlink("sub/parent/../secret", folder / "sneaky")  # sub/parent is the folder, then .. leaves it
    with pytest.raises(CheckpointFormatError, match="outside its folder"):
        read_inside(str(folder), "sneaky", 100)


def test_loops_special_files_and_folders_are_refused(folder):
    os.symlink("b", folder / "a")
    os.symlink("a", folder / "b")
    with pytest.raises(CheckpointFormatError, match="a loop"):
        read_inside(str(folder), "a", 100)
    os.mkfifo(folder / "fifo")
    with pytest.raises(CheckpointFormatError, match="is a FIFO, not a regular file"):
        read_inside(str(folder), "fifo", 100)  # refused without blocking
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        read_inside(str(folder), "sub", 100)
    with pytest.raises(CheckpointFormatError, match="file not found"):
        read_inside(str(folder), "nothing", 100)
    with pytest.raises(CheckpointFormatError, match="more than 3 bytes; expected a one-line tag name"):
        read_inside(str(folder), "vocab.txt", 3, "a one-line tag name")
    (folder / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointFormatError, match="not UTF-8 text"):
        read_small_text(str(folder), "latest")


def test_a_file_of_a_kernel_pseudo_filesystem_is_refused():
    """/proc files pass as regular files (size 0, generated on read): refused by filesystem type."""
    with pytest.raises(CheckpointFormatError, match="procfs"):
        read_inside("/proc/self", "environ", 1 << 20)
    with pytest.raises(CheckpointFormatError, match="sysfs"):
        read_inside("/sys/kernel", "uevent_seqnum", 100)

"""The memory tier's root (pyckpt.deepspeed.tiers.memory_root): hostile roots and job folders refused
(links, files where folders should be, group/other-writable modes, other owners), creation mode 0700
whatever the umask, job ids that are one folder name (tiers.job_identity), torchrun's node numbering
(tiers.nodes), the budget (only
the job's own tree counted, links not followed) and the fit with its spare margin, listing and
removing a job's folders without following anything out of them. Fast: no DeepSpeed."""

import contextlib
import errno
import os
import shutil
import stat
import uuid

import pytest

from pyckpt import MemoryRootError
from pyckpt.deepspeed.tiers import job_identity as ji
from pyckpt.deepspeed.tiers import memory_root as mr
from pyckpt.deepspeed.tiers import nodes
from pyckpt.deepspeed.tiers.memory_root import Budget

OTHER_UID = 65534  # nobody
MiB = 1 << 20


@contextlib.contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def folder(path, mode=0o700):
    os.makedirs(path)
    os.chmod(path, mode)
    return str(path)


def write(path, nbytes):
    with open(path, "wb") as f:
        f.write(b"\x5a" * nbytes)  # not zeros: no sparse file, blocks really allocated
        f.flush()
        os.fsync(f.fileno())
    return str(path)


def refused(call, *words):
    with pytest.raises(MemoryRootError) as info:
        call()
    text = str(info.value)
    assert "\n" not in text
    for word in words:
        assert word in text, (word, text)
    assert isinstance(info.value, OSError)
    return text


def everything_under(path):
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (mr.ENV_ROOT, ji.ENV_JOB, ji.ENV_RUN_ID, "GROUP_RANK", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- where ------------------------------------------------------------------------------------

def test_default_root_is_per_user_under_dev_shm_unless_set(clean_env):
    assert mr.default_root() == f"/dev/shm/pyckpt-{os.getuid()}"
    clean_env.setenv(mr.ENV_ROOT, "/somewhere/else")
    assert mr.default_root() == "/somewhere/else"
    clean_env.setenv(mr.ENV_ROOT, "")
    assert mr.default_root() == f"/dev/shm/pyckpt-{os.getuid()}"


def test_job_id_precedence(clean_env):
    assert ji.job_id() == "default"
    clean_env.setenv(ji.ENV_RUN_ID, "3f2a-elastic")
    assert ji.job_id() == "3f2a-elastic"
    clean_env.setenv(ji.ENV_JOB, "my.job_1")
    assert ji.job_id() == "my.job_1"
    assert ji.job_id("given") == "given"


@pytest.mark.parametrize("bad", ["..", ".", ".hidden", "/", "a/b", "../x", "", "x" * 129, "job\n", "a\nb", "a b",
                                 "jöb", "a\x00b"])
def test_job_id_must_be_one_folder_name(clean_env, bad):
    with pytest.raises(ValueError, match="one folder name") as info:
        ji.job_id(bad)
    assert "\n" not in str(info.value)
    if bad and "\x00" not in bad:  # an empty variable counts as unset; the environment holds no NUL
        clean_env.setenv(ji.ENV_JOB, bad)
        with pytest.raises(ValueError, match=r"\$PYCKPT_JOB_ID"):
            ji.job_id()


def test_job_id_limits_and_torchrun_id_named(clean_env):
    assert ji.job_id("x" * 128) == "x" * 128
    assert ji.job_id("A-z_0.9") == "A-z_0.9"
    clean_env.setenv(ji.ENV_RUN_ID, "host:29500")
    with pytest.raises(ValueError, match=r"\$TORCHELASTIC_RUN_ID"):
        ji.job_id()


def test_job_folder_validates_the_job_name_too(tmp_path):
    root = str(tmp_path / "root")
    for bad in ("..", "a/b", ""):
        with pytest.raises(ValueError):
            mr.node_memory_folder(root, bad, 0)
        with pytest.raises(ValueError):
            mr.remove_job(root, bad)
    assert not os.path.exists(root)


def test_node_of(clean_env):
    assert nodes.node_of(5) == 0  # unknown local world size: one node
    assert nodes.node_of(5, 2) == 2
    assert nodes.node_of(7, 4) == 1
    assert nodes.node_of(0, 4) == 0
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    assert nodes.node_of(5) == 1
    assert nodes.node_of(5, 1) == 5  # the argument wins
    for bad in ((-1, 2), (1, 0), (1, -2), (True, 2), (1.0, 2)):
        with pytest.raises(ValueError):
            nodes.node_of(*bad)
    clean_env.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match=r"\$LOCAL_WORLD_SIZE"):
        nodes.node_of(5)


def test_this_node(clean_env):
    assert nodes.this_node() == 0
    clean_env.setenv("RANK", "5")
    assert nodes.this_node() == 0  # no local world size: one node
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    assert nodes.this_node() == 2
    clean_env.setenv("GROUP_RANK", "7")  # torchrun's own number wins
    assert nodes.this_node() == 7
    clean_env.setenv("GROUP_RANK", "-1")
    with pytest.raises(ValueError, match=r"\$GROUP_RANK"):
        nodes.this_node()


# -- the root ---------------------------------------------------------------------------------

def test_open_root_creates_0700_and_returns_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with umask(0o022):
        path = mr.open_root("mem/root")
    assert path == str(tmp_path / "mem" / "root")
    assert mode_of(path) == 0o700
    assert mr.open_root(path) == path  # idempotent: there already, still fine


def test_open_root_is_0700_under_a_permissive_umask(tmp_path):
    with umask(0):
        path = mr.open_root(str(tmp_path / "a" / "b" / "root"))
        job = mr.node_memory_folder(path, "j", 0)
    for p in (tmp_path / "a", tmp_path / "a" / "b", path, os.path.dirname(job), job):
        assert mode_of(p) == 0o700, p


def test_open_root_is_0700_under_a_strict_umask(tmp_path):
    # mkdir's mode passes through the umask: 0o277 would leave 0500, a root we could not write to
    with umask(0o277):
        path = mr.open_root(str(tmp_path / "p" / "root"))
        job = mr.node_memory_folder(path, "j", 1)
    for p in (tmp_path / "p", path, os.path.dirname(job), job):
        assert mode_of(p) == 0o700, p


def test_open_root_keeps_the_spelling_of_linked_parents(tmp_path):
    real = folder(tmp_path / "real", 0o755)
    os.symlink(real, tmp_path / "alias")
    path = mr.open_root(str(tmp_path / "alias" / "root"))
    assert path == str(tmp_path / "alias" / "root")  # abspath, not realpath
    assert os.path.isdir(os.path.join(real, "root"))


def test_parents_are_the_users(tmp_path):
    """Only the root itself is checked: a world-writable sticky parent (as /dev/shm is) is fine."""
    parent = folder(tmp_path / "shm", 0o1777)
    assert mode_of(mr.open_root(os.path.join(parent, "root"))) == 0o700


def test_absent_root_without_create(tmp_path):
    with pytest.raises(FileNotFoundError):
        mr.open_root(str(tmp_path / "a" / "root"), create=False)
    assert not os.path.exists(tmp_path / "a")
    with pytest.raises(ValueError):
        mr.open_root("")
    refused(lambda: mr.open_root("/"), "filesystem's root")


@pytest.mark.parametrize("create", [True, False])
def test_root_that_is_a_link_to_our_folder_is_refused(tmp_path, create):
    target = folder(tmp_path / "target")
    link = tmp_path / "root"
    os.symlink(target, link)
    refused(lambda: mr.open_root(str(link), create=create), str(link), "symbolic link")
    refused(lambda: mr.node_memory_folder(str(link), "j", 0), "symbolic link")
    assert os.listdir(target) == []


def test_root_that_is_a_link_to_tmp_is_refused(tmp_path):
    link = tmp_path / "root"
    os.symlink("/tmp", link)
    before = set(os.listdir("/tmp"))
    refused(lambda: mr.open_root(str(link)), str(link), "symbolic link")
    job = f"pyckpt-test-{uuid.uuid4().hex}"
    refused(lambda: mr.node_memory_folder(str(link), job, 0), "symbolic link")
    refused(lambda: mr.remove_job(str(link), job), "symbolic link")
    refused(lambda: mr.budget(str(link), job), "symbolic link")
    assert not os.path.exists(os.path.join("/tmp", job))
    assert set(os.listdir("/tmp")) - before == set()
    assert os.path.islink(link)


def test_dangling_link_root_is_refused_not_created_through(tmp_path):
    link = tmp_path / "root"
    os.symlink(tmp_path / "nowhere", link)
    refused(lambda: mr.open_root(str(link)), "symbolic link")
    assert not os.path.exists(tmp_path / "nowhere")


def test_a_file_where_the_root_should_be(tmp_path):
    path = write(tmp_path / "root", 10)
    refused(lambda: mr.open_root(path), path, "regular file", "must be a folder")
    refused(lambda: mr.open_root(path, create=False), "regular file")
    os.mkfifo(tmp_path / "fifo")
    refused(lambda: mr.open_root(str(tmp_path / "fifo")), "FIFO")


def test_a_file_where_the_job_folder_should_be(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    job = write(os.path.join(root, "j"), 10)
    refused(lambda: mr.node_memory_folder(root, "j", 0), job, "regular file")
    refused(lambda: mr.node_folders(root, "j"), job, "regular file")
    refused(lambda: mr.budget(root, "j"), job, "regular file")
    refused(lambda: mr.remove_job(root, "j"), job, "regular file")
    assert os.path.isfile(job)


def test_a_file_where_the_node_folder_should_be(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    os.mkdir(os.path.join(root, "j"), 0o700)
    node = write(os.path.join(root, "j", "node2"), 10)
    refused(lambda: mr.node_memory_folder(root, "j", 2), node, "regular file")
    assert os.path.isfile(node)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o720, 0o1777])
def test_root_writable_by_group_or_others_is_refused(tmp_path, mode):
    root = folder(tmp_path / "root", mode)
    refused(lambda: mr.open_root(root), root, f"{mode:04o}", "writable by group or others")
    refused(lambda: mr.node_memory_folder(root, "j", 0), "writable by group or others")
    assert os.listdir(root) == []


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o500])
def test_root_not_writable_by_others_is_accepted(tmp_path, mode):
    root = folder(tmp_path / "root", mode)
    assert mr.open_root(root) == root
    assert mode_of(root) == mode  # an existing root's mode is the user's: not changed


@pytest.mark.parametrize("level", ["job", "node"])
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_job_and_node_folders_writable_by_others_are_refused(tmp_path, level, mode):
    root = mr.open_root(str(tmp_path / "root"))
    node = mr.node_memory_folder(root, "j", 0)
    bad = node if level == "node" else os.path.dirname(node)
    os.chmod(bad, mode)
    refused(lambda: mr.node_memory_folder(root, "j", 0), bad, "writable by group or others")
    if level == "node":
        refused(lambda: mr.node_folders(root, "j"), bad, "writable by group or others")


@pytest.mark.parametrize("level", ["job", "node"])
def test_job_and_node_folders_that_are_links_are_refused(tmp_path, level):
    root = mr.open_root(str(tmp_path / "root"))
    target = folder(tmp_path / "target")
    if level == "job":
        os.symlink(target, os.path.join(root, "j"))
        bad = os.path.join(root, "j")
    else:
        os.mkdir(os.path.join(root, "j"), 0o700)
        bad = os.path.join(root, "j", "node0")
        os.symlink(target, bad)
    refused(lambda: mr.node_memory_folder(root, "j", 0), bad, "symbolic link")
    assert os.listdir(target) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_root_owned_by_another_user_is_refused(tmp_path):
    root = folder(tmp_path / "root")
    os.chown(root, OTHER_UID, OTHER_UID)
    refused(lambda: mr.open_root(root), root, f"uid {OTHER_UID}", "not by this user")
    refused(lambda: mr.node_memory_folder(root, "j", 0), f"uid {OTHER_UID}")
    refused(lambda: mr.remove_job(root, "j"), f"uid {OTHER_UID}")
    assert os.listdir(root) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("level", ["job", "node"])
def test_job_and_node_folders_owned_by_another_user_are_refused(tmp_path, level):
    root = mr.open_root(str(tmp_path / "root"))
    node = mr.node_memory_folder(root, "j", 0)
    bad = node if level == "node" else os.path.dirname(node)
    os.chown(bad, OTHER_UID, OTHER_UID)
    refused(lambda: mr.node_memory_folder(root, "j", 0), bad, f"uid {OTHER_UID}")


def test_ownership_is_judged_by_the_effective_uid(tmp_path, monkeypatch):
    """The same rule without root: a folder of ours is another user's to a process whose effective
    uid differs."""
    root = mr.open_root(str(tmp_path / "root"))
    mr.node_memory_folder(root, "j", 0)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    refused(lambda: mr.open_root(root), root, f"uid {me}", f"(uid {me + 1})")
    refused(lambda: mr.node_memory_folder(root, "j", 0), f"uid {me}")


def test_root_on_a_filesystem_statvfs_fails_on_is_refused(tmp_path, monkeypatch):
    root = str(tmp_path / "root")

    def failing(fd):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "fstatvfs", failing)
    refused(lambda: mr.open_root(root), root, "statvfs", "free space")
    refused(lambda: mr.budget(root, "j"), "statvfs")


def test_a_real_root_under_dev_shm(clean_env):
    assert os.path.isdir("/dev/shm")
    root = f"/dev/shm/pyckpt-test-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        assert mr.open_root(root) == root
        assert mode_of(root) == 0o700
        node = mr.node_memory_folder(root, "job", 1)
        write(os.path.join(node, "f"), MiB)
        b = mr.budget(root, "job", limit=64 * MiB)
        st = os.statvfs(root)
        assert 0 < b.free <= st.f_blocks * st.f_frsize
        assert MiB <= b.used < 2 * MiB
        assert mr.fits(MiB, b) is None
        assert mr.node_folders(root, "job") == [(1, node)]
        assert mr.remove_job(root, "job")[-1] == os.path.join(root, "job")
        assert os.listdir(root) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert not os.path.exists(root)


# -- job folders ------------------------------------------------------------------------------

def test_job_folder_layout(tmp_path):
    root = str(tmp_path / "root")
    node = mr.node_memory_folder(root, "j", 3)
    assert node == os.path.join(root, "j", "node3")
    assert os.path.isdir(node)
    assert mr.node_memory_folder(root, "j", 3) == node  # again: same folder, no error
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            mr.node_memory_folder(root, "j", bad)


def test_job_folders_lists_only_real_node_folders(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    wanted = [mr.node_memory_folder(root, "j", n) for n in (0, 2, 10)]
    job = os.path.join(root, "j")
    elsewhere = folder(tmp_path / "elsewhere")
    os.symlink(elsewhere, os.path.join(job, "node1"))  # a link: ignored, not followed
    write(os.path.join(job, "node3"), 1)  # a file
    for odd in ("node07", "node", "nodex", "node-1", "Node4", "node5.tmp", "node٣", "other"):
        os.mkdir(os.path.join(job, odd), 0o700)
    mr.node_memory_folder(root, "other-job", 4)
    assert mr.node_folders(root, "j") == [(0, wanted[0]), (2, wanted[1]), (10, wanted[2])]
    assert mr.node_folders(root, "other-job") == [(4, os.path.join(root, "other-job", "node4"))]


def test_job_folders_of_nothing(tmp_path):
    assert mr.node_folders(str(tmp_path / "absent"), "j") == []
    assert not os.path.exists(tmp_path / "absent")
    root = mr.open_root(str(tmp_path / "root"))
    assert mr.node_folders(root, "j") == []
    assert os.listdir(root) == []  # listing creates nothing


# -- budget -----------------------------------------------------------------------------------

def test_room_arithmetic():
    assert Budget(free=100, limit=None, used=50).room() == 100
    assert Budget(free=100, limit=80, used=50).room() == 30
    assert Budget(free=100, limit=500, used=50).room() == 100  # the filesystem is the tighter bound
    assert Budget(free=100, limit=40, used=50).room() == 0  # over the limit already: never negative
    assert Budget(free=0, limit=None, used=0).room() == 0
    assert Budget(free=100, limit=0, used=0).room() == 0  # a limit of 0 is a limit


def test_budget_counts_only_the_jobs_tree_and_follows_no_link(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    node0 = mr.node_memory_folder(root, "j", 0)
    node1 = mr.node_memory_folder(root, "j", 1)
    write(os.path.join(node0, "a"), MiB)
    os.mkdir(os.path.join(node1, "tag"))
    write(os.path.join(node1, "tag", "b"), MiB)
    os.link(os.path.join(node0, "a"), os.path.join(node1, "a-again"))  # one file's blocks, counted once
    big = write(tmp_path / "big", 8 * MiB)  # outside the root
    big_dir = folder(tmp_path / "bigdir")
    write(os.path.join(big_dir, "x"), 8 * MiB)
    os.symlink(big, os.path.join(node0, "link-to-big"))
    os.symlink(big_dir, os.path.join(node0, "link-to-bigdir"))
    os.symlink(big_dir, os.path.join(root, "j", "node5"))
    other = mr.node_memory_folder(root, "other", 0)  # another job's bytes are not this job's
    write(os.path.join(other, "c"), 4 * MiB)
    write(os.path.join(root, "stray"), 4 * MiB)

    b = mr.budget(root, "j", limit=100 * MiB)
    assert 2 * MiB <= b.used < 2 * MiB + 256 * 1024
    assert b.limit == 100 * MiB
    assert b.free > 0
    assert mr.budget(root, "absent-job").used == 0
    assert mr.budget(root, "other").used >= 4 * MiB


def test_budget_free_is_what_an_unprivileged_writer_may_use(tmp_path, monkeypatch):
    root = mr.open_root(str(tmp_path / "root"))
    # f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, ...: the blocks reserved for root are not ours
    fake = os.statvfs_result((8192, 4096, 1000, 500, 300, 0, 0, 0, 0, 255))
    monkeypatch.setattr(os, "fstatvfs", lambda fd: fake)
    assert mr.budget(root, "j") == Budget(free=300 * 4096, limit=None, used=0)


def test_budget_refuses_a_bad_limit(tmp_path):
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(ValueError):
            mr.budget(str(tmp_path / "root"), "j", bad)


def test_fits_without_a_limit_and_the_margin():
    b = Budget(free=1000, limit=None, used=0)
    assert mr.fits(950, b) is None  # 5% of 1000 kept spare
    assert mr.fits(951, b) is not None
    assert mr.fits(1000, b, margin=0) is None
    assert mr.fits(1001, b, margin=0) is not None
    assert mr.fits(500, b, margin=0.5) is None
    assert mr.fits(501, b, margin=0.5) is not None
    assert mr.fits(0, b, margin=1) is None
    assert mr.fits(1, b, margin=1) is not None
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            mr.fits(1, b, margin=bad)
    with pytest.raises(ValueError):
        mr.fits(-1, b)


def test_fits_with_a_limit():
    b = Budget(free=10_000, limit=1000, used=600)
    assert mr.fits(400, b) is None  # the margin is of the free space, the limit is the user's own
    assert mr.fits(401, b) is not None
    tight = Budget(free=1000, limit=10_000, used=0)
    assert mr.fits(950, tight) is None  # the free space (less its margin) is the tighter bound
    assert mr.fits(951, tight) is not None
    assert mr.fits(1, Budget(free=10_000, limit=0, used=0)) is not None


def test_fits_says_why_in_one_line_in_human_units():
    gib = 1 << 30
    why = mr.fits(30 * gib, Budget(free=100 * gib, limit=40 * gib, used=12 * gib))
    assert "\n" not in why
    for part in ("30.0 GiB", "28.0 GiB", "100.0 GiB", "5%", "limit 40.0 GiB", "12.0 GiB used"):
        assert part in why, (part, why)
    why = mr.fits(3 * gib, Budget(free=2 * gib, limit=None, used=0))
    assert "3.0 GiB" in why and "no limit" in why
    why = mr.fits(1900, Budget(free=1000, limit=None, used=0))
    assert why.startswith("a memory checkpoint of 1.9 KiB does not fit: room for 950 B (1000 B free"), why


# -- removing ---------------------------------------------------------------------------------

def test_remove_job_removes_that_job_only(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    node = mr.node_memory_folder(root, "j", 0)
    os.mkdir(os.path.join(node, "tag"))
    write(os.path.join(node, "tag", "f"), 100)
    keep = mr.node_memory_folder(root, "k", 0)
    write(os.path.join(keep, "g"), 100)
    removed = mr.remove_job(root, "j")
    job = os.path.join(root, "j")
    assert removed == [os.path.join(node, "tag", "f"), os.path.join(node, "tag"), node, job]
    assert not os.path.lexists(job)
    assert everything_under(root) == ["k", "k/node0", "k/node0/g"]
    assert mr.remove_job(root, "j") == []
    assert mr.remove_job(str(tmp_path / "absent"), "j") == []
    assert not os.path.exists(tmp_path / "absent")


def test_remove_job_follows_no_link_out_of_the_job_folder(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    node = mr.node_memory_folder(root, "j", 0)
    outside = folder(tmp_path / "outside")
    write(os.path.join(outside, "precious"), 100)
    os.mkdir(os.path.join(outside, "sub"))
    write(os.path.join(outside, "sub", "more"), 100)
    lone = write(tmp_path / "lone", 100)
    os.symlink(outside, os.path.join(node, "to-outside"))
    os.symlink(lone, os.path.join(node, "to-lone"))
    os.symlink(outside, os.path.join(root, "j", "node9"))
    before = everything_under(outside)

    removed = mr.remove_job(root, "j")
    assert os.path.join(node, "to-outside") in removed
    assert not os.path.lexists(os.path.join(root, "j"))
    assert everything_under(outside) == before == ["precious", "sub", "sub/more"]
    assert os.path.isfile(lone)


def test_remove_job_unlinks_a_link_in_place_of_the_job_folder(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    outside = folder(tmp_path / "outside")
    write(os.path.join(outside, "precious"), 100)
    os.symlink(outside, os.path.join(root, "j"))
    assert mr.remove_job(root, "j") == [os.path.join(root, "j")]
    assert not os.path.lexists(os.path.join(root, "j"))
    assert everything_under(outside) == ["precious"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_remove_job_refuses_another_users_job_folder(tmp_path):
    root = mr.open_root(str(tmp_path / "root"))
    node = mr.node_memory_folder(root, "j", 0)
    write(os.path.join(node, "f"), 100)
    job = os.path.dirname(node)
    os.chown(job, OTHER_UID, OTHER_UID)
    refused(lambda: mr.remove_job(root, "j"), job, f"uid {OTHER_UID}", "only its own")
    assert everything_under(root) == ["j", "j/node0", "j/node0/f"]


def test_remove_job_refuses_a_job_folder_of_another_effective_uid(tmp_path, monkeypatch):
    root = mr.open_root(str(tmp_path / "root"))
    node = mr.node_memory_folder(root, "j", 0)
    me = os.geteuid()
    job = os.path.dirname(node)
    real_stat = os.stat

    def stat_as_other(path, *a, dir_fd=None, **k):  # the job folder, and only it, reads as another user's
        st = real_stat(path, *a, dir_fd=dir_fd, **k)
        if path == "j" and dir_fd is not None:
            return os.stat_result(tuple(st)[:4] + (me + 1, ) + tuple(st)[5:])
        return st

    monkeypatch.setattr(os, "stat", stat_as_other)
    refused(lambda: mr.remove_job(root, "j"), job, f"uid {me + 1}")
    monkeypatch.undo()
    assert os.path.isdir(node)


def test_pyckpt_clean_removes_one_jobs_memory_tier_and_nothing_else(tmp_path):
    """`pyckpt clean --memory JOB` removes that job's folder under the root, not another job's, and never
    what a link inside leads to; a root others can write is refused; OUTPUT and --memory exclude each other."""
    import subprocess
    import sys

    root = tmp_path / "root"
    mr.node_memory_folder(mr.open_root(str(root)), "mine", 0)
    mr.node_memory_folder(str(root), "theirs", 0)
    (root / "mine" / "node0" / "s1").mkdir()
    (root / "mine" / "node0" / "s1" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (root / "mine" / "node0" / "link").symlink_to(outside)

    def clean(*args):
        return subprocess.run([sys.executable, "-m", "pyckpt", "clean", *map(str, args)], capture_output=True, text=True,
                              cwd=tmp_path)

    proc = clean("--memory", "mine", "--memory-root", root, "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout)["memory"] == str(root / "mine")
    assert sorted(os.listdir(root)) == ["theirs"] and (outside / "keep.txt").read_text() == "mine"
    proc = clean("--memory", "mine", "--memory-root", root)
    assert proc.returncode == 0 and "no memory tier of job mine" in proc.stderr
    os.chmod(root, 0o777)
    proc = clean("--memory", "theirs", "--memory-root", root)
    assert proc.returncode == 1 and "writable by group or others" in proc.stderr and proc.stderr.count("\n") == 1
    assert sorted(os.listdir(root)) == ["theirs"]
    assert clean("--memory", "theirs", "x", "--memory-root", root).returncode == 2
    assert clean("--memory", "../x", "--memory-root", root).returncode == 1

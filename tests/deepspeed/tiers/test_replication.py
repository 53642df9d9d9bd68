"""Peer replication's transport (pyckpt.deepspeed.tiers: replica_protocol, replica_sender, replica_receiver): a
tag folder sent over loopback arrives byte for byte, verified, published atomically with `latest`; everything
a sender says is untrusted (token, node, tag and file names, counts, sizes, CRCs, the end marker), a failure
leaves nothing published and no staging, and a dead, slow or hostile peer neither hangs nor stops the
receiver. Fast: loopback sockets, tmp_path folders, no DeepSpeed."""

import contextlib
import errno
import os
import socket
import stat
import threading
import time
import zlib

import pytest
import torch

from pyckpt import ReplicationError
from pyckpt.deepspeed.tiers import replica_receiver, replica_sender
from pyckpt.deepspeed.tiers import replica_protocol as proto
from pyckpt.deepspeed.tiers import replica_sender as sender
from pyckpt.deepspeed.tiers.replica_receiver import ReplicaReceiver
from pyckpt.deepspeed.tiers.replica_sender import send_folder
from pyckpt.errors import MemoryRootError
from pyckpt.execution import publisher

MiB = 1 << 20


@pytest.fixture
def token():
    return os.urandom(32)


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job"
    path.mkdir(mode=0o700)
    return path


@contextlib.contextmanager
def receiving(job, token, **options):
    receiver = ReplicaReceiver(str(job), token, **options).start()
    try:
        yield receiver
    finally:
        receiver.close()


def make_folder(path, files):
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def tree(path):
    """{relative path: bytes} of every file under ``path`` (links are reported, not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            out[rel] = "link" if os.path.islink(full) else open(full, "rb").read()
    return out


def hidden_entries(job):
    """Staging folders, locks and pointer temporaries left anywhere under the job folder."""
    return [os.path.join(d, n) for d, dirs, files in os.walk(job) for n in dirs + files if n.startswith(".")]


def wait_for(condition, what, limit=30.0):
    """Polls ``condition`` until it holds; a liveness bound, not a timing assertion."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"{what} did not happen within {limit} s")


def failures(receiver, n=1):
    """The first ``n`` failed results, once the receiver has recorded them."""
    return wait_for(lambda: [x for x in receiver.results() if not x.ok][:n] if
                    len([x for x in receiver.results() if not x.ok]) >= n else None, f"{n} recorded failure(s)")


def session(receiver, token, files, node=1, tag="global_step1", total=None, count=None, manifest=None):
    """A sender speaking the protocol by hand (an honest hello and manifest unless told otherwise)."""
    entries = [(name, len(data)) for name, data in files]
    data = proto.manifest_bytes(entries) if manifest is None else manifest
    s = sender._Session(receiver.address, token, 30)
    try:
        s.hello(node, tag, len(entries) if count is None else count,
                sum(size for _, size in entries) if total is None else total, len(data))
        s.manifest(data)
    except BaseException:
        s.sock.close()
        raise
    return s


def send_files(s, files, crcs=None):
    for i, (_, data) in enumerate(files):
        s.send(data)
        s.send(proto.CRC.pack(zlib.crc32(data) if crcs is None else crcs[i]))


@pytest.fixture
def source(tmp_path):
    """A small tag folder: a real torch file, a few MB of random bytes, an empty file, a JSON file."""
    folder = make_folder(tmp_path / "src" / "global_step1", {"empty": b"", "notes.json": b'{"step": 1}',
                                                             "zero_pp_rank_0_mp_rank_00_optim_states.pt":
                                                                 os.urandom(3 * MiB + 17)})
    torch.save({"module": {"w": torch.arange(1000, dtype=torch.float32)}, "global_steps": 1},
               folder / "mp_rank_00_model_states.pt")
    return folder


# -- what arrives ------------------------------------------------------------------------------

def test_a_folder_is_replicated_byte_for_byte_and_published_with_latest(job, token, source):
    with receiving(job, token) as r:
        sent = send_folder(str(source), 1, "global_step1", r.address, token)
    replica = job / "replica-of-node1" / "global_step1"
    assert tree(replica) == tree(source)
    assert (job / "replica-of-node1" / "latest").read_text() == "global_step1"
    loaded = torch.load(replica / "mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(loaded["module"]["w"], torch.arange(1000, dtype=torch.float32))
    total = sum(len(v) for v in tree(source).values())
    assert (sent.files, sent.bytes) == (4, total)
    [result] = r.results()
    assert (result.ok, result.node, result.tag, result.files, result.bytes, result.error) == \
        (True, 1, "global_step1", 4, total, "")
    assert result.folder == str(replica)
    for folder in (job / "replica-of-node1", replica):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert hidden_entries(job) == []


def test_a_replica_writes_over_the_free_slots_files_in_place_and_before_receive_runs_first(job, token, tmp_path):
    """The replica folder's free slot (a retired replica's files): a file of the same name is written
    over in place (the same inode, cut to the new size), a linked one is left alone; ``before_receive``
    (the owner's retention) runs before the data flows."""
    from pyckpt.deepspeed.tiers import free_slot

    folder = job / "replica-of-node1"
    slot = folder / free_slot.NAME
    slot.mkdir(parents=True, mode=0o700)
    (slot / "f").write_bytes(b"x" * 100_000)  # bigger than what comes
    (slot / "g").write_bytes(b"old g")
    os.link(slot / "g", tmp_path / "g-elsewhere")  # linked: stays where it is
    inode = os.stat(slot / "f").st_ino
    source = make_folder(tmp_path / "src", {"f": b"new f", "g": b"new g"})
    seen = []
    with receiving(job, token, before_receive=lambda path: seen.append(sorted(os.listdir(os.path.join(path, ".pyckpt-slot"))))) as r:
        send_folder(str(source), 1, "s2", r.address, token)
    replica = folder / "s2"
    assert tree(replica) == {"f": b"new f", "g": b"new g"}
    assert os.stat(replica / "f").st_ino == inode
    assert os.stat(replica / "g").st_nlink == 1 and (tmp_path / "g-elsewhere").read_bytes() == b"old g"
    assert seen == [["f", "g"]]


def test_two_tags_in_a_row_then_the_same_tag_again_replaced_atomically(job, token, tmp_path, monkeypatch):
    a = make_folder(tmp_path / "a", {"f": b"first"})
    b = make_folder(tmp_path / "b", {"f": b"second"})
    seen = []
    real_exchange = publisher._core.rename_exchange

    def exchange(staging, output):
        # the old replica is in place, whole, until the very exchange that puts the new one there
        seen.append((tree(output), tree(staging)))
        return real_exchange(staging, output)

    monkeypatch.setattr(publisher._core, "rename_exchange", exchange)
    with receiving(job, token) as r:
        send_folder(str(a), 3, "step1", r.address, token)
        send_folder(str(b), 3, "step2", r.address, token)
        assert (job / "replica-of-node3" / "latest").read_text() == "step2"
        (a / "f").write_bytes(b"first, again")
        (a / "g").write_bytes(b"new")
        send_folder(str(a), 3, "step1", r.address, token)
    assert seen == [({"f": b"first"}, {"f": b"first, again", "g": b"new"})]
    assert tree(job / "replica-of-node3") == {"step1/f": b"first, again", "step1/g": b"new", "step2/f": b"second",
                                              "latest": b"step1"}
    assert [x.ok for x in r.results()] == [True, True, True]


def test_replicas_of_two_nodes_side_by_side(job, token, tmp_path):
    one = make_folder(tmp_path / "one", {"x": os.urandom(2 * MiB)})
    two = make_folder(tmp_path / "two", {"x": os.urandom(2 * MiB), "y": b"y"})
    errors = []

    def send(folder, node):
        try:
            send_folder(str(folder), node, "global_step7", r.address, token)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with receiving(job, token) as r:
        threads = [threading.Thread(target=send, args=(one, 1)), threading.Thread(target=send, args=(two, 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert tree(job / "replica-of-node1") == {"global_step7/x": (one / "x").read_bytes(), "latest": b"global_step7"}
    assert tree(job / "replica-of-node2") == {"global_step7/x": (two / "x").read_bytes(), "global_step7/y": b"y",
                                              "latest": b"global_step7"}


# -- who may send --------------------------------------------------------------------------------

def test_a_wrong_token_is_refused_and_nothing_published(job, token, source):
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused.*HMAC does not match the job's token"):
            send_folder(str(source), 1, "global_step1", r.address, os.urandom(32))
        [result] = failures(r)
    assert not result.ok and result.node is None
    assert result.error.startswith(f"{result.peer}: the hello's HMAC does not match")
    assert os.listdir(job) == []


def test_the_receiver_must_prove_it_holds_the_token(token, source):
    """A listener that took over the address but lacks the token gets nothing of the checkpoint."""
    listener = socket.create_server(("127.0.0.1", 0))
    after_hello = []

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(proto.MAGIC_RECEIVER + proto._verdict(proto.OK, os.urandom(32)))
            fixed = proto._recv_exact(conn, proto.HELLO.size)
            proto._recv_exact(conn, proto.HELLO.unpack(fixed)[-1])
            conn.sendall(proto._verdict(proto.OK, os.urandom(32)))  # a proof made up without the token
            conn.settimeout(5)
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                after_hello.append(data)

    t = threading.Thread(target=impostor)
    t.start()
    try:
        with pytest.raises(ReplicationError, match="did not prove it holds the job's token"):
            send_folder(str(source), 1, "global_step1", listener.getsockname(), token)
    finally:
        t.join()
        listener.close()
    assert after_hello == []


def test_garbage_instead_of_a_hello_is_refused_and_the_receiver_serves_on(job, token, source):
    with receiving(job, token) as r:
        with socket.create_connection(r.address) as s:
            s.recv(1024)
            s.sendall(os.urandom(proto.HELLO.size))
            s.recv(1024)
        [result] = failures(r)
        assert "not a pyckpt replica sender" in result.error
        send_folder(str(source), 1, "global_step1", r.address, token)
    assert tree(job / "replica-of-node1" / "global_step1") == tree(source)


# -- what a sender may say ----------------------------------------------------------------------

@pytest.mark.parametrize("tag, rule", [
    ("a/b", "contains a slash"), ("..", "is '.' or '..'"), (".", "is '.' or '..'"), ("", "is empty"),
    ("step\x1b[2J", "control character"), ("step\x85", "control character"), (".hidden", "starts with '.'"),
    ("s" * 129, "is 129 bytes long; a tag is at most 128 bytes"), ("latest", "pointer file"), (" step1", "whitespace"),
])
def test_a_hostile_tag_is_refused_before_anything_is_written(job, token, source, tag, rule):
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused"):
            send_folder(str(source), 1, tag, r.address, token)
        [result] = failures(r)
    assert rule in result.error and result.error.startswith(result.peer)
    assert "\n" not in result.error and "\x1b" not in result.error and "\x85" not in result.error
    assert os.listdir(job) == []


def test_the_longest_plain_tag_is_taken(job, token, source):
    with receiving(job, token) as r:
        send_folder(str(source), 1, "s" * 128, r.address, token)
    assert (job / "replica-of-node1" / "latest").read_text() == "s" * 128


@pytest.mark.parametrize("name, rule", [
    ("a/b", "contains a slash"), ("../escape", "contains a slash"), ("..", "is '.' or '..'"),
    ("x\x00y", "control character"), ("x\ny", "control character"), (".hidden", "starts with '.'"),
    ("f" * 256, "is 256 bytes long (at most 255)"), (b"\xff\xfe", "not valid UTF-8"), ("", "is empty"),
])
def test_a_hostile_file_name_is_refused_before_any_file_is_written(job, token, name, rule):
    with receiving(job, token) as r:
        files = [("good", b"1"), (name, b"2")]
        manifest = proto.manifest_bytes([("good", 1), (name, 1)])
        with pytest.raises(ReplicationError, match="refused.*at the manifest"):
            session(r, token, files, manifest=manifest)
        [result] = failures(r)
    assert rule in result.error
    assert tree(job) == {} and hidden_entries(job) == []


def test_a_name_twice_in_the_manifest_is_refused(job, token):
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="appears twice"):
            session(r, token, [("f", b"1"), ("f", b"2")])
    assert tree(job) == {}


def test_a_sub_folder_of_the_tag_folder_is_refused_by_the_sender_as_the_receiver_refuses_it(job, token, tmp_path):
    """One rule on both ends: a receiver takes plain file names only, so the sender refuses a sub-folder
    before it connects (not every time at the receiver, after the hello)."""
    folder = make_folder(tmp_path / "t", {"f": b"1"})
    make_folder(folder / "sub", {"g": b"2"})
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match=r"/t/sub: is a sub-folder; a replica holds only the tag folder's "
                                                   r"own files") as info:
            send_folder(str(folder), 1, "global_step1", r.address, token)
        assert r.results() == []  # nothing reached the receiver
        with pytest.raises(ReplicationError, match=r"file name 'sub/g' contains a slash"):  # what it refuses
            session(r, token, [("f", b"1"), ("sub/g", b"2")])
    assert "\n" not in str(info.value) and tree(job) == {}


def test_one_tag_limit_at_the_save_and_at_the_receiver(tmp_path):
    """A tag the receiver refuses for its length is refused by the save itself, before anything runs, in
    one line; one byte shorter, both take it (bytes of UTF-8 on both ends)."""
    import types

    from pyckpt.deepspeed.save import save_checkpoint
    from pyckpt.deepspeed.save.request import check_tag
    from pyckpt.execution.staging_names import TAG_MAX

    assert TAG_MAX == 128
    for tag in ("s" * 128, "é" * 64, "s" * 129, "é" * 65, "s" * 127 + "é"):
        receiver_refuses = "a tag is at most 128 bytes" in proto.tag_problem(tag.encode())
        assert receiver_refuses == (len(tag.encode()) > 128)
        if receiver_refuses:
            with pytest.raises(ValueError, match=rf"is {len(tag.encode())} bytes long; a tag is at most 128 bytes"):
                check_tag(tag)
        else:
            assert check_tag(tag) == tag
    engine = types.SimpleNamespace(checkpoint_engine=object(), use_node_local_storage=lambda: False, global_steps=1)
    with pytest.raises(ValueError) as info:
        save_checkpoint(engine, tmp_path / "save", tag="s" * 129)
    assert "129 bytes long" in str(info.value) and "nothing was written" in str(info.value)
    assert "\n" not in str(info.value) and not os.path.exists(tmp_path / "save")


@pytest.mark.parametrize("tag", [
    "global_step1", "step 1", "é" * 64, "a\\b", "", ".", "..", ".hidden", "a/b", "s" * 129, "latest",
    "latest_universal", " step", "step\t", "step\x1b[2J", "step\x85", "a\x00b", "\udcff", "x" * 300,
])
def test_the_save_and_the_receiver_take_the_same_tags(tag):
    """One tag rule (pyckpt.execution.tag_rule): a tag the save takes is one a peer's receiver takes,
    and the other way round, in the same words."""
    from pyckpt.deepspeed.save.request import check_tag
    from pyckpt.execution.tag_rule import tag_problem

    problem = tag_problem(tag)
    try:
        raw = tag.encode("utf-8")
    except UnicodeEncodeError:
        raw = tag.encode("utf-8", "surrogateescape")  # what a sender puts on the wire
    assert proto.tag_problem(raw) == ("is not valid UTF-8" if problem.startswith("is not valid UTF-8") else problem)
    if problem:
        with pytest.raises(ValueError, match="nothing was written") as info:
            check_tag(tag)
        assert problem in str(info.value) and "\n" not in str(info.value)
    else:
        assert check_tag(tag) == tag


def test_node_numbers_are_bounded(job, token, source):
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match=r"node number 1048576 is out of range"):
            session(r, token, [("f", b"1")], node=1 << 20)
        send_folder(str(source), (1 << 20) - 1, "global_step1", r.address, token)
    assert os.listdir(job) == [f"replica-of-node{(1 << 20) - 1}"]
    for node in (-1, 1 << 20, 1.0, True):
        with pytest.raises(ValueError, match="node must be"):
            send_folder(str(source), node, "global_step1", ("127.0.0.1", 1), token)


def test_file_counts_are_bounded(job, token, tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "t", {f"f{i}": b"x" for i in range(4)})
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused.*at the hello.*0 files: it must hold 1 to"):
            session(r, token, [], count=0)
        monkeypatch.setattr(replica_receiver, "MAX_FILES", 3)
        monkeypatch.setattr(replica_sender, "MAX_FILES", 3)
        with pytest.raises(ReplicationError, match="refused.*at the hello.*4 files: it must hold 1 to 3"):
            # the receiver's rule, not the sender's: an honest sender lists up to the bound it knows
            session(r, token, [(f"f{i}", b"x") for i in range(4)])
        with pytest.raises(ReplicationError, match="more than 3 files"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
    assert tree(job) == {}


@pytest.mark.parametrize("total, manifest, rule", [
    (3, proto.manifest_bytes([("a", 1), ("b", 1)]), "add up to 2 bytes, the hello announced 3"),
    (1, proto.manifest_bytes([("a", 1), ("b", 1)]), "add up to more than the 1 bytes"),
    (2, proto.manifest_bytes([("a", 1), ("b", 1)]) + b"\0", "bytes past its 2 files"),
    (2, proto.manifest_bytes([("a", 1)]), "ends after 1 of the 2 files"),
    (2, proto.manifest_bytes([("a", 1)]) + proto.ENTRY.pack(5, 1) + b"b", "ends inside the name of file 1"),
    (2, proto.manifest_bytes([("a", 1), ("b", 1)]) + b"\0" * 600, "is longer than 2 names"),
])
def test_a_manifest_that_disagrees_with_the_hello_is_refused(job, token, total, manifest, rule):
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused"):
            session(r, token, [("a", b"1"), ("b", b"2")], total=total, manifest=manifest)
        [result] = failures(r)
    assert rule in result.error
    assert tree(job) == {}


def test_max_bytes_is_refused_before_writing(job, token, source):
    total = sum(len(v) for v in tree(source).values())
    with receiving(job, token, max_bytes=total - 1) as r:
        with pytest.raises(ReplicationError, match=rf"refused.*at the hello: a replica of {total} bytes is over "
                                                   rf"max_bytes \({total - 1}\)"):
            send_folder(str(source), 1, "global_step1", r.address, token)
    assert os.listdir(job) == []
    with receiving(job, token, max_bytes=total) as r:
        send_folder(str(source), 1, "global_step1", r.address, token)
    assert tree(job / "replica-of-node1" / "global_step1") == tree(source)


def test_free_space_is_checked_before_accepting_and_before_each_file(job, token, tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "t", {"a": os.urandom(MiB), "b": os.urandom(MiB)})
    monkeypatch.setattr(replica_receiver, "_free_bytes", lambda fd: MiB)
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused.*at the hello.*does not fit"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
        assert os.listdir(job) == []
        # room at the hello and for the first file; the tmpfs fills up (training saves) before the second
        asked = []
        monkeypatch.setattr(replica_receiver, "_free_bytes",
                            lambda fd: asked.append(fd) or (100 * MiB if len(asked) <= 2 else MiB))
        with pytest.raises(ReplicationError, match="refused.*file 'b': the rest of the replica no longer fits"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
    assert len(asked) == 3
    assert tree(job) == {} and hidden_entries(job) == []


# -- what a sender sends ------------------------------------------------------------------------

def test_a_size_lie_leaves_nothing_published_and_no_staging(job, token):
    files = [("f", os.urandom(MiB))]
    with receiving(job, token) as r:
        s = session(r, token, files)
        s.send(files[0][1][:100_000])
        s.sock.close()
        [result] = failures(r)
    assert "the sender closed the connection during file 'f' after 100000 of its 1048576 bytes" in result.error
    assert tree(job) == {} and hidden_entries(job) == []


def test_a_crc_mismatch_is_refused(job, token):
    files = [("a", os.urandom(MiB)), ("b", b"second")]
    with receiving(job, token) as r:
        s = session(r, token, files)
        with pytest.raises(ReplicationError, match="refused.*file 'a': CRC-32 of the 1048576 bytes received"):
            send_files(s, files, crcs=[zlib.crc32(files[0][1]) ^ 1, zlib.crc32(files[1][1])])
            s.finish()
        s.sock.close()
        [result] = failures(r)
    assert "CRC-32" in result.error
    assert tree(job) == {} and hidden_entries(job) == []


def test_a_crc_mismatch_reaches_send_folder_with_its_reason(job, token, tmp_path, monkeypatch):
    """The refusal comes while the sender still has more to send than the sockets buffer: its send
    fails on the closed connection, and it reports the reason that arrived before, not the reset."""
    folder = make_folder(tmp_path / "t", {"a": os.urandom(MiB), "b": os.urandom(32 * MiB)})
    real = sender._file_crc
    monkeypatch.setattr(replica_sender, "_file_crc", lambda f, buf: real(f, buf) ^ (f.name == "a"))
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused.*file 'a': CRC-32"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
    assert tree(job) == {} and hidden_entries(job) == []


@pytest.mark.parametrize("windows", [1, proto.WINDOWS + 1])
def test_a_write_that_fails_is_refused_and_leaves_nothing(job, token, tmp_path, monkeypatch, windows):
    """A full tmpfs after the free-space check (another writer took the room): the write's own error,
    seen at the file's end (one window) or when a window is to be reused (more than all of them)."""
    folder = make_folder(tmp_path / "t", {"a": os.urandom(proto.CHUNK * (windows - 1) + 1)})

    def full(fd, buf, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(replica_receiver, "_write_all", full)
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match=r"refused.*file 'a': writing it failed \(No space left on device\)"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
    assert tree(job) == {} and hidden_entries(job) == []


def test_the_end_marker_is_required(job, token):
    files = [("f", b"data")]
    with receiving(job, token) as r:
        s = session(r, token, files)
        send_files(s, files)
        s.send(b"PYCKENDX")
        with pytest.raises(ReplicationError, match="does not end with the end marker"):
            s.verdict()
        s.sock.close()
    assert tree(job) == {} and hidden_entries(job) == []


def test_send_folder_refuses_links_and_special_files_naming_them(job, token, tmp_path):
    with receiving(job, token) as r:
        folder = make_folder(tmp_path / "t", {"f": b"1"})
        (tmp_path / "elsewhere").write_bytes(b"secret")
        os.symlink(tmp_path / "elsewhere", folder / "link")
        with pytest.raises(ReplicationError, match=f"{folder / 'link'}: is a symbolic link"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
        os.unlink(folder / "link")
        os.mkfifo(folder / "fifo")
        with pytest.raises(ReplicationError, match=f"{folder / 'fifo'}: is a FIFO"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
        os.unlink(folder / "fifo")
        os.symlink(folder, tmp_path / "folder-link")
        with pytest.raises(ReplicationError, match="the folder to replicate is a symbolic link"):
            send_folder(str(tmp_path / "folder-link"), 1, "global_step1", r.address, token)
        assert r.results() == []  # refused before connecting
    assert tree(job) == {}


def test_a_file_that_changes_while_it_is_sent_fails_the_transfer(job, token, tmp_path, monkeypatch):
    folder = make_folder(tmp_path / "t", {"a": b"before"})
    real = sender._collect

    def collect_then_change(path):
        files = real(path)
        (folder / "a").write_bytes(b"after, longer")
        return files

    monkeypatch.setattr(replica_sender, "_collect", collect_then_change)
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match=f"{folder / 'a'}: changed while being replicated"):
            send_folder(str(folder), 1, "global_step1", r.address, token)
        failures(r)
    assert tree(job) == {} and hidden_entries(job) == []


# -- dead, slow and many peers ------------------------------------------------------------------

def test_a_silent_sender_times_out_and_the_next_sender_is_served(job, token, source):
    with receiving(job, token, hello_timeout=0.5, max_connections=1, max_waiting=1) as r:
        with socket.create_connection(r.address) as idle:
            idle.recv(1024)  # the greeting; then nothing
            [result] = failures(r)
            assert "no complete hello within 0.5 s of the greeting" in result.error
            idle.settimeout(10)
            assert idle.recv(1024) == b""  # the receiver dropped it
        send_folder(str(source), 1, "global_step1", r.address, token)
    assert tree(job / "replica-of-node1" / "global_step1") == tree(source)


def test_a_sender_that_stalls_during_the_data_times_out(job, token, source):
    files = [("f", os.urandom(MiB))]
    with receiving(job, token, timeout=0.5) as r:
        s = session(r, token, files)
        s.send(files[0][1][:1000])  # then nothing, the connection left open
        try:
            [result] = failures(r)
        finally:
            s.sock.close()
        assert "no data from the sender for 0.5 s" in result.error and result.node == 1
        send_folder(str(source), 1, "global_step1", r.address, token)
    assert tree(job / "replica-of-node1") == {**{f"global_step1/{k}": v for k, v in tree(source).items()},
                                              "latest": b"global_step1"}
    assert hidden_entries(job) == []


def test_a_hello_trickled_byte_by_byte_is_dropped(job, token):
    """The per-receive timeout alone would let a peer sending a byte now and then hold a slot forever."""
    with receiving(job, token, hello_timeout=0.5) as r:
        with socket.create_connection(r.address) as slow:
            slow.recv(1024)
            stop = threading.Event()

            def trickle():
                with contextlib.suppress(OSError):
                    while not stop.wait(0.1):
                        slow.send(b"P")

            t = threading.Thread(target=trickle)
            t.start()
            try:
                [result] = failures(r)
            finally:
                stop.set()
                t.join()
    assert "no complete hello within 0.5 s of the greeting" in result.error


def test_transfers_beyond_the_bound_are_told_the_receiver_is_busy(job, token, source):
    """The bound counts senders that proved the token: two transfers under way, a third is refused."""
    files = [("f", os.urandom(MiB))]
    with receiving(job, token, max_connections=2) as r:
        held = [session(r, token, files, node=n) for n in (2, 3)]
        with pytest.raises(ReplicationError, match="refused.*the receiver is busy: 2 transfers in progress"):
            send_folder(str(source), 1, "global_step1", r.address, token)
        for s in held:
            s.sock.close()
        failures(r, 3)
        send_folder(str(source), 1, "global_step1", r.address, token)
    assert tree(job / "replica-of-node1" / "global_step1") == tree(source)


@pytest.mark.parametrize("flood", [3, 4 * 3], ids=["fewer-than-the-waiting-places", "three-times-them"])
def test_a_flood_of_idle_connections_does_not_keep_a_replica_out(job, token, source, flood):
    """Connections that never send a hello (here: more than the transfer slots, and three times the
    places for waiting ones) neither hold a transfer's slot nor turn the job's sender away: its replica
    is published while every idle connection still sits within its hello deadline (which is long here,
    so only the admission's structure lets the replica through, not the idle ones timing out). The
    deadline then drops them, each with one line saying so."""
    with receiving(job, token, max_connections=1, max_waiting=4, hello_timeout=600) as r:
        idle = [socket.create_connection(r.address) for _ in range(flood)]
        # every idle connection accepted (a greeting or, for those pushed out already, the close) first
        for s in idle:
            s.settimeout(30)
            s.recv(1024)
        send_folder(str(source), 1, "global_step1", r.address, token)
        pushed_out = max(0, flood + 1 - 4)  # the sender took the longest-waiting idle one's place too

        def dropped():
            found = [x for x in r.results() if "this one the longest" in x.error]
            return found if len(found) == pushed_out else None

        dropped = wait_for(dropped, "the idle connections pushed out recorded") if pushed_out else []
        results = r.results()
        assert [x.ok for x in results if x.node == 1] == [True]
        # none of the idle ones was dropped by its deadline: the replica did not wait for it
        assert not any("no complete hello" in x.error for x in results)
        assert all(x.node is None and "dropped before its hello was complete" in x.error for x in dropped)
        for s in idle:
            s.close()
    assert tree(job / "replica-of-node1" / "global_step1") == tree(source)


def test_an_idle_connection_is_dropped_at_the_hello_deadline(job, token, source):
    with receiving(job, token, max_connections=1, max_waiting=2, hello_timeout=0.3) as r:
        with socket.create_connection(r.address) as idle:
            idle.recv(1024)
            [result] = failures(r)
            idle.settimeout(10)
            assert idle.recv(1024) == b""  # the receiver dropped it
    assert "no complete hello within 0.3 s of the greeting; the connection was dropped" in result.error
    assert result.node is None and "\n" not in result.error


def test_one_transfer_at_a_time_per_node(job, token, source):
    files = [("f", os.urandom(MiB))]
    with receiving(job, token) as r:
        s = session(r, token, files, node=1, tag="global_step2")
        s.send(files[0][1][:1000])
        with pytest.raises(ReplicationError, match="a replica of node 1 is being received on another connection"):
            send_folder(str(source), 1, "global_step1", r.address, token)
        send_folder(str(source), 2, "global_step1", r.address, token)  # another node meanwhile
        s.send(files[0][1][1000:])
        s.send(proto.CRC.pack(zlib.crc32(files[0][1])))
        s.finish()
        s.sock.close()
    assert tree(job / "replica-of-node1") == {"global_step2/f": files[0][1], "latest": b"global_step2"}
    assert (job / "replica-of-node2" / "latest").read_text() == "global_step1"


def test_close_during_a_transfer_leaves_no_staging(job, token):
    files = [("f", os.urandom(4 * MiB))]
    r = ReplicaReceiver(str(job), token).start()
    try:
        s = session(r, token, files)
        s.send(files[0][1][:MiB])
        [staging] = wait_for(lambda: [p for p in hidden_entries(job)
                                      if ".pyckpt-tmp-" in p and os.path.exists(os.path.join(p, "f"))],
                             "the staging folder with its first file")
        assert stat.S_IMODE(os.stat(staging).st_mode) == 0o700
        assert os.path.exists(os.path.join(staging, "f"))
    finally:
        r.close()
    s.sock.close()
    [result] = r.results()
    assert not result.ok and "the receiver was closed during the transfer" in result.error
    assert tree(job) == {} and hidden_entries(job) == []


def test_results_are_bounded(job, token, monkeypatch):
    monkeypatch.setattr(replica_receiver, "MAX_RESULTS", 2)
    with receiving(job, token) as r:
        for _ in range(3):
            with socket.create_connection(r.address) as s:
                s.recv(1024)
        failures(r, 2)
        wait_for(lambda: not r._active, "the three connections to end")
        assert len(r.results()) == 2


# -- the folders it writes into -----------------------------------------------------------------

def test_a_replica_folder_that_is_a_link_is_refused_and_not_followed(job, token, source, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, job / "replica-of-node1")
    with receiving(job, token) as r:
        with pytest.raises(ReplicationError, match="refused.*at the manifest: the replica cannot be staged here.*"
                                                   "symbolic link"):
            send_folder(str(source), 1, "global_step1", r.address, token)
    assert os.listdir(elsewhere) == []


def test_a_hostile_job_folder_is_refused(tmp_path, token):
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(MemoryRootError, match="writable by group or others"):
        ReplicaReceiver(str(open_to_all), token)
    os.symlink(tmp_path, tmp_path / "link")
    with pytest.raises(MemoryRootError, match="symbolic link"):
        ReplicaReceiver(str(tmp_path / "link"), token)


def test_tokens_too_short_to_be_secret_are_refused(job):
    with pytest.raises(ValueError, match="token must be 16 to"):
        ReplicaReceiver(str(job), b"short")
    with pytest.raises(TypeError, match="token must be bytes"):
        ReplicaReceiver(str(job), "a string token of some length")


def test_the_longest_plain_file_name_is_taken(job, token, tmp_path):
    folder = make_folder(tmp_path / "t", {"f" * 255: b"long name"})
    with receiving(job, token) as r:
        send_folder(str(folder), 1, "global_step1", r.address, token)
    assert tree(job / "replica-of-node1" / "global_step1") == {"f" * 255: b"long name"}


def test_a_node_s_next_replica_may_follow_the_verdict_at_once(job, token, tmp_path, monkeypatch):
    """A sender's ring sends one checkpoint right after the other: the receiver frees the node's slot
    before it tells the sender the replica is published, so the next one is never refused as a second
    transfer of that node (it was, now and then, between the verdict and the connection's end; a slow
    close on the receiving side makes that window certain here)."""
    import socket
    import threading

    real_close = socket.socket.close

    def slow_close(sock):
        if threading.current_thread().name == "pyckpt-replica-receive":
            time.sleep(0.05)
        return real_close(sock)

    monkeypatch.setattr(socket.socket, "close", slow_close)
    folder = make_folder(tmp_path / "a", {"f": b"x"})
    with receiving(job, token) as r:
        for i in range(5):
            send_folder(str(folder), 5, f"s{i}", r.address, token)
    assert [x.ok for x in r.results()] == [True] * 5


# -- the job's wait for its replicas (pyckpt.deepspeed.wait_for_replication) ----------------------

@contextlib.contextmanager
def leading_node_0(token, address, monkeypatch):
    """This process as node 0's leader of a two-node job, its ring sender aimed at ``address``."""
    from pyckpt.deepspeed.tiers import links
    from pyckpt.deepspeed.tiers.ring_sender import Sender

    found = links.Nodes(rank=0, node=0, count=2, leaders=[0, 2], ranks=[(0, 2), (2, 2)], token=token,
                        addresses=[None, tuple(address)])
    found.sender = Sender(found)
    monkeypatch.setitem(links._NODES, ("test", 4, "job", True), found)
    try:
        yield found
    finally:
        found.close()


def test_wait_for_replication_is_true_once_the_peer_verified_the_newest_and_false_at_the_timeout_otherwise(
        job, token, tmp_path, monkeypatch):
    """A replica verified earlier does not stand for a newer checkpoint still on its way: a peer that
    never answers leaves wait_for_replication False at its timeout (it returned True then, from the
    earlier replica's verdict), and a failed send is False at once."""
    import pyckpt.deepspeed as pd

    assert pd.wait_for_replication(timeout=0) is True  # one node, or no save yet: nothing to wait for
    first = make_folder(tmp_path / "mem" / "s1", {"model": os.urandom(MiB), "pyckpt-node.json": b"{}"})
    second = make_folder(tmp_path / "mem" / "s2", {"model": os.urandom(MiB), "pyckpt-node.json": b"{}"})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection into its backlog and never answers
    try:
        with receiving(job, token) as r, leading_node_0(token, r.address, monkeypatch) as found:
            found.sender.offer(str(first), "s1")
            assert pd.wait_for_replication() is True
            assert tree(job / "replica-of-node0" / "s1") == tree(first)  # the peer's copy, verified and published
            assert [(x.ok, x.tag) for x in r.results()] == [(True, "s1")]
            found.addresses[1] = silent.getsockname()
            found.sender.offer(str(second), "s2")
            assert pd.wait_for_replication(timeout=0.5) is False
            assert not (job / "replica-of-node0" / "s2").exists()
            silent.close()  # the waiting connection is reset: the send fails
            wait_for(lambda: found.sender.failed, "the send to the closed peer to fail")
            assert pd.wait_for_replication(timeout=30) is False  # failed: no wait, no True
            found.addresses[1] = r.address
            found.sender.offer(str(second), "s2")  # the next offer goes to a peer that answers
            assert pd.wait_for_replication(timeout=60) is True
            assert tree(job / "replica-of-node0" / "s2") == tree(second)
    finally:
        silent.close()


def test_wait_for_replication_checks_its_timeout():
    import pyckpt.deepspeed as pd

    for bad in (-1, float("nan"), "10"):
        with pytest.raises(ValueError, match="timeout must be"):
            pd.wait_for_replication(timeout=bad)

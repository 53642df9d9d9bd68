"""A replication killed half-way, on either side (SIGKILL of a real process): the replica that was
there stays whole and counted, nothing half-received counts, and the next transfer clears what the
killed one left (its staging folder is memory on a tmpfs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from memory_shares import describe

from pyckpt.deepspeed.tiers import node_manifest as nm
from pyckpt.deepspeed.tiers.job_identity import Identity
from pyckpt.deepspeed.tiers.resume_choice import inventory
from pyckpt.deepspeed.tiers.replica_receiver import ReplicaReceiver
from pyckpt.deepspeed.tiers.replica_sender import send_folder
from pyckpt.errors import ReplicationError

MODEL = "cd" * 32
SAVE_DIR = "/work/save"
IDENTITY = Identity("job", SAVE_DIR, False)
BIG = 4 << 20


def share(folder, tag, step, node=1):
    path = os.path.join(folder, tag)
    os.makedirs(path)
    files = {"zero_pp_rank_2_mp_rank_00_optim_states.pt": os.urandom(BIG), "small.pt": b"s" * 100}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    describe(path, save="save-" + tag, job="job", step=step, node=node, nodes=2, world=4, ranks=(2, 2), model=MODEL,
             save_dir=SAVE_DIR)
    return path


@pytest.fixture
def node0(tmp_path):
    """Node 0's memory folder of the job, as the memory root makes it."""
    path = tmp_path / "root" / "job" / "node0"
    for p in (tmp_path / "root", tmp_path / "root" / "job", path):
        p.mkdir(mode=0o700)
    return path


def _state(node0):
    replicas = node0 / "replica-of-node1"
    names = sorted(os.listdir(replicas))
    shares = sorted((m.tag, m.step) for _, m in nm.shares(str(replicas)))
    return names, shares


def _wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


SENDER = """
import os, sys, time
from pyckpt.deepspeed.tiers import replica_sender
folder, tag, host, port, token, marker = sys.argv[1:7]
real = replica_sender._Session.send_file

def half_then_hang(self, f, crc):
    # half of the big file on the wire, then this process hangs until the test kills it
    if f.size > 1 << 20:
        with open(f.path, "rb") as src:
            self.sock.sendall(src.read(f.size // 2))
        open(marker, "w").close()
        time.sleep(600)
    return real(self, f, crc)

replica_sender._Session.send_file = half_then_hang
replica_sender.send_folder(folder, 1, tag, (host, int(port)), bytes.fromhex(token))
"""


def test_a_sender_killed_mid_transfer_leaves_the_older_replica_whole_and_counted(node0, tmp_path):
    token = os.urandom(32)
    s3, s4 = share(str(tmp_path / "src"), "s3", 3), share(str(tmp_path / "src"), "s4", 4)
    marker = tmp_path / "half-sent"
    with ReplicaReceiver(str(node0), token).start() as receiver:
        send_folder(s3, 1, "s3", receiver.address, token)
        proc = subprocess.Popen([sys.executable, "-c", SENDER, s4, "s4", *map(str, receiver.address), token.hex(),
                                 str(marker)], cwd="/")
        try:
            _wait_for(marker.exists, "the sender never got half-way")
            names, _ = _state(node0)
            assert any(n.startswith(".s4.pyckpt-tmp-") for n in names), names  # being received
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
        _wait_for(lambda: len(receiver.results()) == 2, "the receiver never ended the cut transfer")
        cut = receiver.results()[1]
        assert not cut.ok and "closed the connection" in cut.error, cut
        # the cut transfer's staging went with it; s3 stays the replica, whole, and latest names it
        assert _state(node0) == (["latest", "s3"], [("s3", 3)])
        assert (node0 / "replica-of-node1" / "latest").read_text() == "s3"
        assert [(h.origin, h.step) for h in inventory(str(tmp_path / "root"), IDENTITY)] == [(1, 3)]
        send_folder(s4, 1, "s4", receiver.address, token)
    assert _state(node0) == (["latest", "s3", "s4"], [("s3", 3), ("s4", 4)])


RECEIVER = """
import os, sys, time
from pyckpt.deepspeed.tiers.replica_receiver import ReplicaReceiver
job, token, port_file = sys.argv[1:4]
r = ReplicaReceiver(job, bytes.fromhex(token)).start()
with open(port_file + ".tmp", "w") as f:
    f.write(str(r.address[1]))
os.rename(port_file + ".tmp", port_file)
time.sleep(600)
"""


def _receiver_process(node0, token, port_file):
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(node0), token.hex(), str(port_file)], cwd="/")
    _wait_for(port_file.exists, "the receiver never listened")
    return proc, ("127.0.0.1", int(port_file.read_text()))


def test_a_receiver_killed_mid_transfer_publishes_nothing_and_the_next_one_clears_its_staging(node0, tmp_path,
                                                                                                 monkeypatch):
    from pyckpt.deepspeed.tiers import replica_sender

    token = os.urandom(32)
    s3, s4, s5 = (share(str(tmp_path / "src"), f"s{i}", i) for i in (3, 4, 5))
    proc, address = _receiver_process(node0, token, tmp_path / "port1")
    try:
        send_folder(s3, 1, "s3", address, token)
        half_sent = threading.Event()
        go_on = threading.Event()
        real = replica_sender._Session.send_file

        def half_then_wait(self, f, crc):
            if f.size > 1 << 20:
                with open(f.path, "rb") as src:
                    self.sock.sendall(src.read(f.size // 2))
                half_sent.set()
                go_on.wait(30)
            return real(self, f, crc)

        monkeypatch.setattr(replica_sender._Session, "send_file", half_then_wait)
        failure = []

        def send():
            try:
                send_folder(s4, 1, "s4", address, token, timeout=10)
            except ReplicationError as exc:
                failure.append(exc)

        sender = threading.Thread(target=send)
        sender.start()
        assert half_sent.wait(30)
        _wait_for(lambda: any(n.startswith(".s4.pyckpt-tmp-") for n in _state(node0)[0]), "nothing was staged")
        os.kill(proc.pid, signal.SIGKILL)  # the receiving node's process dies mid-file
        proc.wait()
        go_on.set()
        sender.join(30)
        assert failure and "s4" in str(failure[0]), failure  # the sender hears the replica did not count
        monkeypatch.undo()
        names, shares = _state(node0)
        assert shares == [("s3", 3)] and any(n.startswith(".s4.pyckpt-tmp-") for n in names), names
        assert [(h.origin, h.step) for h in inventory(str(tmp_path / "root"), IDENTITY)] == [(1, 3)]
    finally:
        if proc.poll() is None:
            proc.kill()
    # a new receiver (the restarted process) takes the next replica, of another tag, and clears the
    # killed one's staging first
    proc, address = _receiver_process(node0, token, tmp_path / "port2")
    try:
        send_folder(s5, 1, "s5", address, token)
    finally:
        proc.kill()
        proc.wait()
    names, shares = _state(node0)
    assert names == ["latest", "s3", "s5"] and shares == [("s3", 3), ("s5", 5)], names

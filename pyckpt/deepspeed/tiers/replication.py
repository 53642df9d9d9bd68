"""Copying one node's checkpoint folder into a peer node's memory tier, verified before it counts.

A :class:`ReplicaReceiver` runs on the node that keeps the replica: a background thread accepts
connections and writes what a peer sends into ``<job folder>/replica-of-node<N>/<tag>``.
:func:`send_folder` runs on the node whose files they are. Everything the receiver reads is
untrusted until checked: the peer must prove it holds the job's token, every number and name is
checked before anything is written, the bytes are checked against the announced size and CRC-32
before the replica is published, and a failure of one connection leaves nothing behind and does not
stop the receiver serving the others.

Wire protocol (version 1; integers big-endian; ``R`` the receiver, ``S`` the sender)::

    R -> S  greeting  b"PYCKRPL1", verdict(0, nonce_r: 32 random bytes)    (or verdict(1, "busy ..."))
    S -> R  hello     b"PYCKRPS1", nonce_s (32), mac_s (32), node u32, count u32, total u64,
                      manifest_len u32, tag_len u16, tag (UTF-8)
    R -> S  verdict   0 with mac_r (32)  |  1 with the reason
    S -> R  manifest  count x (name_len u16, size u64, name UTF-8), manifest_len bytes in all
    R -> S  verdict   0  |  1 with the reason
    S -> R  data      for each file in manifest order: its size bytes, then its CRC-32 (u32); then b"PYCKEND1"
    R -> S  verdict   0 ("published")  |  1 with the reason; a refusal may come early, during the data

    verdict(status, payload) = status u8 (0 yes, 1 no), payload_len u16, payload
    mac_s = HMAC-SHA256(token, b"pyckpt replica 1 sender\\0" + nonce_r + nonce_s + the hello's fields
                        from node through tag_len + tag)
    mac_r = HMAC-SHA256(token, b"pyckpt replica 1 receiver\\0" + nonce_s + nonce_r)

Why this shape:

* **Who may send.** The token is the job's secret (shared among its ranks through the process
  group's store); it never crosses the wire. The receiver's fresh nonce makes a recorded hello
  useless, and the MAC covers the node, the counts and the tag, so they cannot be altered on the
  way. The sender checks ``mac_r`` before it sends a byte of the checkpoint, so a process that took
  over the address (a receiver that died, its port reused) learns nothing. The bytes themselves are
  protected against accidents (CRC-32), not against an attacker on the path, and are not encrypted:
  the job's own network is assumed, as for its collectives.
* **Everything checked before the first byte is written.** The hello announces the node, the tag,
  the number of files and their total size, so the token, the node (below 2**20), the tag (one plain
  file name: no '/', not '.' or '..', not hidden, no control character, no whitespace at either end,
  not a pointer file's name, at most 128 bytes of UTF-8, leaving room for the staging names beside
  it), the count (1 to 100,000) and the total (``max_bytes``, the free space of the target
  filesystem) are checked before anything is received beyond the hello's 94 + tag_len bytes; the
  manifest's names (the tag's rules but for the pointer names and the ends, up to 255 bytes; none
  twice) and sizes (adding up to the total, so each within ``max_bytes`` too) before any file is
  created. Only then does the data flow, into a hidden staging folder made mode 0700 under
  ``replica-of-node<N>/`` (itself made 0700 and refused when it is a link, another user's or
  writable by others), each file created ``O_EXCL | O_NOFOLLOW``, the free space asked again before
  each, each file's CRC-32 recomputed from the bytes written and compared with the one the sender
  sends after them. Only when every file's size and CRC matched and the end marker came is the
  folder published (:class:`~pyckpt.execution.publish.Publisher`: one atomic rename, an older
  replica of the same tag swapped out by rename-exchange, then ``replica-of-node<N>/latest``
  replaced atomically to name it). A replica counts only then.
* **The kernel moves the bytes.** The sender hands each file to ``sendfile(2)``; its CRC is taken by
  a second thread reading the file meanwhile, which is why it follows the bytes instead of leading
  them (the transfer does not wait for a pass over the folder first). A file that changes while it
  is sent (its inode, size or modification time) fails the transfer.
* **A refusal reaches the sender.** The receiver replies only once it has read what the sender sent
  up to that point (the whole hello, the whole manifest). A refusal during the data is sent at once
  and the connection closed; the sender, whose next send then fails, reads the reason that arrived
  before the reset.
* **Bounded.** At most ``max_connections`` transfers at once (a further one is told the receiver is
  busy), one at a time per node (a second one for the same node is refused: two could interleave
  their ``latest``); every receive waits at most ``timeout`` seconds, and the whole hello must arrive
  within ``timeout`` of the greeting, so a dead or hostile peer costs one slot for that long; what a
  peer sends before it is known (the hello) is at most 64 KiB; the results kept are the last 1,000.

Nodes are numbered as torchrun numbers them; where replicas go (a ring, by default) is the caller's
policy, not this module's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import hashlib
import hmac
import os
import re
import selectors
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

from ...errors import ReplicationError, check_number, printable
from ...execution.publish import POINTERS, Publisher, pointer_name_problem
from ...native import _core
from .memory_root import MODE, Budget, _check, _open_level, fits, kind_of

MAGIC_RECEIVER = b"PYCKRPL1"
MAGIC_SENDER = b"PYCKRPS1"
END = b"PYCKEND1"
LABEL_SENDER = b"pyckpt replica 1 sender\0"
LABEL_RECEIVER = b"pyckpt replica 1 receiver\0"
NONCE = 32
HELLO = struct.Struct(">8s32s32sIIQIH")  # magic, nonce_s, mac_s, node, count, total, manifest_len, tag_len
FIELDS = struct.Struct(">IIQIH")  # the hello's fields after mac_s, which mac_s covers
ENTRY = struct.Struct(">HQ")  # name_len, size
CRC = struct.Struct(">I")
VERDICT = struct.Struct(">BH")  # status, payload_len
OK, REFUSED = 0, 1

MAX_NODE = 1 << 20
MAX_FILES = 100_000
NAME_MAX = 255
TAG_MAX = 128  # the staging and lock names beside a tag add up to about 100 bytes to it
MAX_TOKEN = 1 << 16
MIN_TOKEN = 16  # bytes: the job's token is meant to be os.urandom(32); a short one is guessable
MAX_RESULTS = 1000
REPLICA_PREFIX = "replica-of-node"

# Receive, checksum and write in windows this big, one being received while the others are written:
# 1 GB over loopback into tmpfs took 0.65-0.73 s with 1 MiB windows, 0.50-0.63 s with 4 MiB (3 of
# them), no better with 8 or 16 MiB. 12 MiB per connection, at most max_connections of them.
CHUNK = 4 << 20
WINDOWS = 3
# What the sender reads at once to take a file's CRC while the kernel sends it.
CRC_CHUNK = 8 << 20

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# A sender's own tree is a tag folder; a deeper one is not a checkpoint and costs a descriptor per level.
_MAX_DEPTH = 16


@dataclass(frozen=True)
class Received:
    """One connection to a :class:`ReplicaReceiver` and what came of it."""

    peer: str  # "host:port" of the sender
    node: Optional[int]  # None when the connection ended before an authenticated hello
    tag: Optional[str]
    files: int  # files written and verified (all of them when ok)
    bytes: int  # bytes written and verified
    ok: bool  # the replica is published and ``replica-of-node<node>/latest`` names it
    error: str  # one line naming the peer and the rule; '' when ok
    folder: Optional[str] = None  # where the replica now is, when ok


@dataclass(frozen=True)
class Sent:
    """What :func:`send_folder` sent: every file, verified and published by the receiver."""

    files: int
    bytes: int
    seconds: float


# -- rules --------------------------------------------------------------------------------------

def name_problem(raw: bytes, limit: int = NAME_MAX) -> str:
    """Why ``raw`` (a file or tag name as received) is not one plain file name of at most ``limit``
    bytes, or '' when it is."""
    if not raw:
        return "is empty"
    if len(raw) > limit:
        return f"is {len(raw)} bytes long (at most {limit})"
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not valid UTF-8"
    if "/" in name or "\\" in name:
        return "contains a slash: it must be one plain file name, no folders"
    if name in (".", ".."):
        return "is '.' or '..'"
    if name.startswith("."):
        return "starts with '.': hidden names are pyckpt's staging and locks"
    bad = _CONTROL.search(name)
    if bad:
        return f"contains the control character {bad.group()!r}"
    return ""


def tag_problem(raw: bytes) -> str:
    """:func:`name_problem` with room for the publisher's hidden names beside the tag (``.<tag>.pyckpt-
    tmp-<host>-<pid>-<random>`` must stay one file name), and what ``latest`` could not name (a
    pointer's own name, whitespace at either end)."""
    problem = name_problem(raw, TAG_MAX)
    if problem:
        return problem
    tag = raw.decode("utf-8")
    if tag in POINTERS:
        return f"is the name of the pointer file {tag!r}"
    return pointer_name_problem(tag)


def _shown(raw: bytes) -> str:
    text = repr(raw.decode("utf-8", "backslashreplace"))
    return text if len(text) <= 80 else text[:77] + "..."


def _free_bytes(fd: int) -> int:
    """Bytes free to us on the filesystem of the folder ``fd`` (statvfs)."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def _check_token(token) -> bytes:
    if not isinstance(token, (bytes, bytearray, memoryview)):
        raise TypeError(f"token must be bytes, not {type(token).__name__}")
    token = bytes(token)
    if not MIN_TOKEN <= len(token) <= MAX_TOKEN:
        raise ValueError(f"token must be {MIN_TOKEN} to {MAX_TOKEN} bytes (e.g. os.urandom(32)), not {len(token)}")
    return token


def _no_delay(sock: socket.socket) -> None:
    # Each small message (a verdict, a CRC after a file's bytes) is what the other side waits for or
    # the last of a burst: Nagle's algorithm would hold it back for an acknowledgement.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def _verdict(status: int, payload: bytes) -> bytes:
    payload = payload[:0xFFFF]
    return VERDICT.pack(status, len(payload)) + payload


def _reason(text: str) -> bytes:
    return printable(text)[:1000].encode("utf-8", "replace")


class _Closed(Exception):
    """The peer closed the connection (or the receiver is closing)."""


class _Refusal(Exception):
    """A rule broken: the reason goes to the sender and into results."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _recv_exact(conn: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            conn.settimeout(min(left, conn.gettimeout() or left))
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise _Closed(f"after {got} of {n} bytes")
        got += k
    return bytes(buf)


# -- receiving ----------------------------------------------------------------------------------

class ReplicaReceiver:
    """Receives one peer node's checkpoint folders into ``<job folder>/replica-of-node<N>/<tag>``, in a
    background thread.

    ``job_folder``: this node's folder of the job in the memory tier (a real folder of ours that
    nobody else may write to: refused with :class:`~pyckpt.errors.MemoryRootError` otherwise);
    ``replica-of-node<N>`` is made in it, mode 0700, when a replica of node N first arrives. ``token``:
    the job's secret (16 bytes or more). ``host``/``port``: where to listen (port 0: any free one; see
    :attr:`address`). ``max_bytes``: the most one replica may hold, or None. ``timeout``: seconds any
    receive may wait (and the whole hello may take). ``max_connections``: transfers at once.

    The protocol, and what is checked, are in the module's docstring. Use it as a context manager, or
    call :meth:`start` and :meth:`close`.
    """

    def __init__(self, job_folder: str, token: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_bytes: Optional[int] = None, *, timeout: float = 60.0, max_connections: int = 8):
        self._token = _check_token(token)
        if max_bytes is not None:
            check_number("max_bytes", max_bytes, integer=True, low=0)
        check_number("timeout", timeout, low=0, low_open=True)
        check_number("max_connections", max_connections, integer=True, low=1, high=1024)
        self.max_bytes = max_bytes
        self.timeout = float(timeout)
        self.max_connections = max_connections
        self.job_folder = os.path.abspath(os.fspath(job_folder))
        self._job_fd = _open_job_folder(self.job_folder)
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family, backlog=max(16, 2 * max_connections))
            self._listener.setblocking(False)
        except BaseException:
            os.close(self._job_fd)
            raise
        self._address = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._active: Dict[threading.Thread, socket.socket] = {}
        self._receiving: set = set()  # nodes with a transfer in progress
        self._results: Deque[Received] = collections.deque(maxlen=MAX_RESULTS)
        self._thread: Optional[threading.Thread] = None
        self._closing = False
        self._closed = False

    @property
    def address(self) -> Tuple[str, int]:
        """``(host, port)`` senders connect to."""
        return (self._address[0], self._address[1])

    def start(self) -> "ReplicaReceiver":
        if self._closed:
            raise RuntimeError("the receiver is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._accept_loop, name="pyckpt-replica-accept", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> "ReplicaReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stops accepting, cuts every transfer in progress (none of them publishes; their staging
        folders are removed) and joins the threads. Published replicas stay."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            active = list(self._active.items())
        for _, conn in active:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a receive in progress; its worker cleans up
            except OSError:
                pass
        for thread, _ in active:
            thread.join()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        os.close(self._job_fd)
        self._closed = True

    def results(self) -> List[Received]:
        """What became of each connection so far (the last 1,000), oldest first."""
        with self._lock:
            return list(self._results)

    # -- threads --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, addr = self._listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:  # out of descriptors, a connection reset before accept: try again
                        time.sleep(0.05)
                        continue
                    try:
                        self._admit(conn, f"{addr[0]}:{addr[1]}")
                    except Exception as exc:  # noqa: BLE001 - e.g. no thread to be had: drop this one, serve on
                        conn.close()
                        self._record(Received(f"{addr[0]}:{addr[1]}", None, None, 0, 0, False,
                                              printable(f"{addr[0]}:{addr[1]}: the receiver could not take the "
                                                        f"connection ({type(exc).__name__}: {exc})")))

    def _admit(self, conn: socket.socket, peer: str) -> None:
        conn.setblocking(True)
        _no_delay(conn)
        with self._lock:
            busy = self._closing or len(self._active) >= self.max_connections
            if not busy:
                thread = threading.Thread(target=self._serve, args=(conn, peer), name="pyckpt-replica-receive",
                                          daemon=True)
                self._active[thread] = conn
        if busy:
            rule = (f"the receiver is busy: {self.max_connections} transfers in progress, the most it takes at once"
                    if not self._closing else "the receiver is closing")
            try:
                conn.settimeout(1.0)  # the greeting is the first thing on the connection: it fits the buffer
                conn.sendall(MAGIC_RECEIVER + _verdict(REFUSED, _reason(rule)))
            except OSError:
                pass
            conn.close()
            self._record(Received(peer, None, None, 0, 0, False, f"{peer}: {rule}"))
            return
        thread.start()

    def _record(self, result: Received) -> None:
        with self._lock:
            self._results.append(result)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        state = _Transfer(peer)
        try:
            conn.settimeout(self.timeout)
            self._transfer(conn, state)
        except _Refusal as exc:
            state.error = exc.reason
            _refuse(conn, exc)
        except socket.timeout:
            state.error = (f"no data from the sender for {self.timeout:g} s (or the hello took longer); "
                           f"the connection was dropped")
        except (_Closed, ConnectionError) as exc:
            state.error = ("the receiver was closed during the transfer" if self._closing else
                           f"the sender closed the connection {state.stage}" + (f" {exc}" if str(exc) else ""))
        except OSError as exc:
            state.error = ("the receiver was closed during the transfer" if self._closing else
                           f"the transfer failed {state.stage} ({exc.strerror or exc})")
        except Exception as exc:  # noqa: BLE001 - one connection must never stop the receiver
            state.error = f"the transfer failed {state.stage} ({type(exc).__name__}: {exc})"
        finally:
            try:
                conn.close()
            finally:
                with self._lock:  # all at once: whoever sees the slot free sees the result too
                    self._active.pop(threading.current_thread(), None)
                    if state.holds_node:
                        self._receiving.discard(state.node)
                    self._results.append(state.result())

    def _transfer(self, conn: socket.socket, state: "_Transfer") -> None:
        nonce_r = os.urandom(NONCE)
        conn.sendall(MAGIC_RECEIVER + _verdict(OK, nonce_r))
        # An unknown peer gets this long for its whole hello, not per byte: it cannot hold a slot by trickling.
        deadline = time.monotonic() + self.timeout
        state.stage = "before its hello was complete"
        fixed = _recv_exact(conn, HELLO.size, deadline)
        magic, nonce_s, mac_s, node, count, total, manifest_len, tag_len = HELLO.unpack(fixed)
        if magic != MAGIC_SENDER:
            raise _Refusal("the hello does not start with pyckpt's replica magic: not a pyckpt replica sender")
        raw_tag = _recv_exact(conn, tag_len, deadline)
        conn.settimeout(self.timeout)
        want = _mac(self._token, LABEL_SENDER, nonce_r, nonce_s, fixed[HELLO.size - FIELDS.size:], raw_tag)
        if not hmac.compare_digest(mac_s, want):
            raise _Refusal("the hello's HMAC does not match the job's token: the sender is not one of the job's ranks")
        state.authenticated(node, raw_tag)
        if node >= MAX_NODE:
            raise _Refusal(f"node number {node} is out of range (below {MAX_NODE})")
        problem = tag_problem(raw_tag)
        if problem:
            raise _Refusal(f"the tag {_shown(raw_tag)} {problem}")
        if count < 1 or count > MAX_FILES:
            raise _Refusal(f"a replica of {count} files: it must hold 1 to {MAX_FILES}")
        if self.max_bytes is not None and total > self.max_bytes:
            raise _Refusal(f"a replica of {total} bytes is over max_bytes ({self.max_bytes})")
        if manifest_len > count * (ENTRY.size + NAME_MAX):
            raise _Refusal(f"a manifest of {manifest_len} bytes is longer than {count} names of at most "
                           f"{NAME_MAX} bytes take")
        too_big = fits(total, Budget(free=_free_bytes(self._job_fd), limit=None, used=0))
        if too_big:
            raise _Refusal(f"the replica does not fit this node's memory tier: {too_big}")
        with self._lock:
            if node in self._receiving:
                raise _Refusal(f"a replica of node {node} is being received on another connection; one at a time "
                               f"per node")
            self._receiving.add(node)
            state.holds_node = True
        conn.sendall(_verdict(OK, _mac(self._token, LABEL_RECEIVER, nonce_s, nonce_r)))

        state.stage = "during the manifest"
        files = _parse_manifest(_recv_exact(conn, manifest_len), count, total)
        self._write_replica(conn, state, files, total)
        try:
            conn.sendall(_verdict(OK, b"published"))
        except OSError:
            pass  # verified and published: the replica counts whether or not the sender hears so

    def _write_replica(self, conn: socket.socket, state: "_Transfer", files: List[Tuple[str, int]],
                       total: int) -> None:
        name = f"{REPLICA_PREFIX}{state.node}"
        path = os.path.join(self.job_folder, name)
        output = os.path.join(path, state.tag)
        with contextlib.ExitStack() as stack:
            try:
                os.close(_open_level(self._job_fd, name, path, "the replica folder", True))  # made 0700, checked
                out = stack.enter_context(Publisher(output, overwrite=True, pointer="latest"))
                staging_fd = os.open(out.staging, _DIR_FLAGS)
            except OSError as exc:
                raise _Refusal(f"the replica cannot be staged here: {exc.strerror or exc}") from None
            try:
                os.fchmod(staging_fd, MODE)
                # the data flows only once there is a private place for it
                conn.sendall(_verdict(OK, b""))
                state.stage = "during the data"
                left = total
                writer = stack.enter_context(contextlib.closing(_Writer()))
                for fname, size in files:
                    too_big = fits(left, Budget(free=_free_bytes(staging_fd), limit=None, used=0))
                    if too_big:
                        raise _Refusal(f"file {fname!r}: the rest of the replica no longer fits this node's memory "
                                       f"tier: {too_big}")
                    state.stage = f"during file {fname!r}"
                    got = _receive_file(conn, staging_fd, fname, size, writer)
                    left -= size
                    (crc,) = CRC.unpack(_recv_exact(conn, CRC.size))
                    if got != crc:
                        raise _Refusal(f"file {fname!r}: CRC-32 of the {size} bytes received is {got:08x}, the sender "
                                       f"sent {crc:08x}")
                    state.files += 1
                    state.bytes += size
                state.stage = "before the end marker"
                if _recv_exact(conn, len(END)) != END:
                    raise _Refusal("the data does not end with the end marker where the manifest's sizes end")
            finally:
                os.close(staging_fd)
            try:
                out.publish()
            except OSError as exc:
                raise _Refusal(f"publishing the verified replica failed: {exc.strerror or exc}") from None
        state.folder = output


class _Transfer:
    """What one connection has achieved so far, for :meth:`ReplicaReceiver.results`."""

    def __init__(self, peer: str):
        self.peer = peer
        self.node: Optional[int] = None
        self.tag: Optional[str] = None
        self.files = 0
        self.bytes = 0
        self.stage = "before its hello"
        self.error = ""
        self.folder: Optional[str] = None
        self.holds_node = False

    def authenticated(self, node: int, raw_tag: bytes) -> None:
        self.node = node
        self.tag = raw_tag.decode("utf-8", "backslashreplace")

    def result(self) -> Received:
        ok = self.folder is not None and not self.error
        error = ""
        if not ok:
            who = self.peer if self.node is None else f"{self.peer} (node {self.node}, tag {self.tag!r})"
            error = printable(f"{who}: {self.error or 'the transfer did not finish'}")
        return Received(self.peer, self.node, self.tag, self.files, self.bytes, ok, error,
                        self.folder if ok else None)


def _open_job_folder(path: str) -> int:
    what = "the job's memory folder"
    _check(os.lstat(path), path, what)
    fd = os.open(path, _DIR_FLAGS)
    try:
        _check(os.fstat(fd), path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _parse_manifest(data: bytes, count: int, total: int) -> List[Tuple[str, int]]:
    """The manifest's (name, size) pairs; every name one plain file name, none twice, the sizes adding
    up to ``total`` (already within max_bytes: so is each file then)."""
    files = []
    seen = set()
    at = 0
    announced = 0
    for i in range(count):
        if at + ENTRY.size > len(data):
            raise _Refusal(f"the manifest ends after {i} of the {count} files the hello announced")
        name_len, size = ENTRY.unpack_from(data, at)
        at += ENTRY.size
        raw = data[at:at + name_len]
        at += name_len
        if len(raw) < name_len:
            raise _Refusal(f"the manifest ends inside the name of file {i}")
        problem = name_problem(raw)
        if problem:
            raise _Refusal(f"file name {_shown(raw)} {problem}")
        name = raw.decode("utf-8")
        if name in seen:
            raise _Refusal(f"file name {name!r} appears twice in the manifest")
        seen.add(name)
        announced += size
        if announced > total:
            raise _Refusal(f"the files' sizes add up to more than the {total} bytes the hello announced")
        files.append((name, size))
    if at != len(data):
        raise _Refusal(f"the manifest has {len(data) - at} bytes past its {count} files")
    if announced != total:
        raise _Refusal(f"the files' sizes add up to {announced} bytes, the hello announced {total}")
    return files


class _Writer:
    """Writes received windows into a file on a second thread, so that copying the next window out of
    the socket overlaps copying this one into the page cache (each takes about as long as the other).
    ``WINDOWS`` buffers of ``CHUNK`` bytes per connection; a window is reused only once written."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pyckpt-replica-write")
        self._buffers = [bytearray(CHUNK) for _ in range(WINDOWS)]
        self._pending: List[Optional[concurrent.futures.Future]] = [None] * WINDOWS
        self._next = 0

    def window(self) -> memoryview:
        """The next free buffer (once its previous write is done; that write's error raised here)."""
        self._wait(self._next)
        return memoryview(self._buffers[self._next])

    def write(self, fd: int, n: int) -> None:
        """Writes the first ``n`` bytes of the buffer :meth:`window` gave to ``fd``, in order."""
        self._pending[self._next] = self._pool.submit(_write_all, fd, self._buffers[self._next], n)
        self._next = (self._next + 1) % WINDOWS

    def flush(self) -> None:
        """Waits for every write handed over; the first error raised."""
        for i in range(WINDOWS):
            self._wait((self._next + i) % WINDOWS)

    def settle(self) -> None:
        """Waits for every write handed over, errors dropped (before closing their file on a failure)."""
        for i in range(WINDOWS):
            with contextlib.suppress(OSError):
                self._wait(i)

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.settle()
        self._pool.shutdown(wait=True)


def _write_all(fd: int, buf: bytearray, n: int) -> None:
    view = memoryview(buf)[:n]
    while view:
        view = view[os.write(fd, view):]


def _receive_file(conn: socket.socket, dir_fd: int, name: str, size: int, writer: _Writer) -> int:
    """Receives ``size`` bytes into the new file ``name`` in ``dir_fd``; returns their CRC-32, taken
    from the very bytes handed to write(2)."""
    fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=dir_fd)
    crc = 0
    done = 0
    try:
        while done < size:
            try:
                view = writer.window()
            except OSError as exc:
                raise _Refusal(f"file {name!r}: writing it failed ({exc.strerror or exc})") from None
            n = min(len(view), size - done)
            got = 0
            while got < n:  # a whole window per write: a receive returns what the socket holds, often less
                k = conn.recv_into(view[got:n], n - got)
                if k == 0:
                    raise _Closed(f"after {done + got} of its {size} bytes")
                got += k
            crc = _core.crc32(view[:n], crc)
            writer.write(fd, n)
            done += n
        try:
            writer.flush()
        except OSError as exc:
            raise _Refusal(f"file {name!r}: writing it failed ({exc.strerror or exc})") from None
    finally:
        writer.settle()  # no write may still be under way when its descriptor is closed
        os.close(fd)
    return crc


def _refuse(conn: socket.socket, refusal: _Refusal) -> None:
    """Tells the sender why. The connection is closed next, unread bytes and all: the sender reads the
    reason after its next send fails (Linux keeps what arrived before a reset readable), and a refused
    peer costs no further reading."""
    try:
        conn.sendall(_verdict(REFUSED, _reason(refusal.reason)))
    except OSError:
        pass


# -- sending ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _File:
    name: str  # relative to the tag folder
    path: str
    size: int
    identity: Tuple[int, int, int, int]  # dev, inode, size, mtime_ns when listed: the file to send


def _identity(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _open(f: _File) -> int:
    try:
        return os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ReplicationError(f"{f.path}: cannot be opened any more ({exc.strerror or exc}); a checkpoint being "
                               f"replicated must not change") from None


def _file_crc(f: _File, buf: bytearray) -> int:
    """The CRC-32 of ``f``'s bytes, read with read(2): a file truncated under a mapping would kill this
    process (SIGBUS), and this runs in a training process."""
    fd = _open(f)
    try:
        view = memoryview(buf)
        crc = 0
        done = 0
        while done < f.size:
            n = os.readv(fd, [view[:min(len(buf), f.size - done)]])
            if n == 0:
                raise ReplicationError(f"{f.path}: shrank from {f.size} to {done} bytes while being replicated")
            crc = _core.crc32(view[:n], crc)
            done += n
    finally:
        os.close(fd)
    return crc


def _collect(tag_folder: str) -> List[_File]:
    """Every regular file under ``tag_folder``, sorted by name; links are not followed, and a link or
    anything but a regular file or folder is a ReplicationError naming it."""
    root = os.path.abspath(os.fspath(tag_folder))
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(root):
            raise ReplicationError(f"{root}: the folder to replicate is a symbolic link; it must be a real "
                                   f"folder (links are not followed)") from None
        raise ReplicationError(f"{root}: the folder to replicate cannot be opened ({exc.strerror or exc})") from None
    files: List[_File] = []
    try:
        _walk(fd, root, "", files, 0)
    finally:
        os.close(fd)
    return sorted(files, key=lambda f: f.name)


def _walk(fd: int, path: str, prefix: str, files: List[_File], depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ReplicationError(f"{path}: folders nested deeper than {_MAX_DEPTH}; not a checkpoint's tag folder")
    with os.scandir(fd) as entries:
        listed = sorted(entries, key=lambda e: e.name)
    for entry in listed:
        child = os.path.join(path, entry.name)
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
            try:
                _walk(sub, child, prefix + entry.name + "/", files, depth + 1)
            finally:
                os.close(sub)
            continue
        if not stat.S_ISREG(st.st_mode):
            raise ReplicationError(f"{child}: is {kind_of(st.st_mode)}; a replica holds only regular files and "
                                   f"folders, and links are not followed")
        if len(files) >= MAX_FILES:
            raise ReplicationError(f"{path}: more than {MAX_FILES} files; a receiver takes at most that many")
        files.append(_File(prefix + entry.name, child, st.st_size, _identity(st)))


class _Session:
    """One connection to a receiver, speaking the sender's half of the protocol. :func:`send_folder`
    is its one user; tests drive it directly to send what an honest sender would not."""

    def __init__(self, address: Tuple[str, int], token: bytes, timeout: float, what: str = "replica"):
        self.where = f"{address[0]}:{address[1]}"
        self.what = what
        self.token = token
        self.stage = "connecting"
        try:
            self.sock = socket.create_connection(tuple(address), timeout=timeout)
        except OSError as exc:
            raise self._failed(exc) from None
        _no_delay(self.sock)

    def __enter__(self) -> "_Session":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def _failed(self, exc: BaseException) -> ReplicationError:
        text = "timed out" if isinstance(exc, socket.timeout) else (getattr(exc, "strerror", None) or str(exc))
        return ReplicationError(f"{self.what}: the connection to {self.where} failed at {self.stage} ({text})")

    def _recv(self, n: int) -> bytes:
        try:
            return _recv_exact(self.sock, n)
        except _Closed:
            raise ReplicationError(f"{self.what}: the receiver at {self.where} closed the connection at "
                                   f"{self.stage}") from None
        except OSError as exc:
            raise self._failed(exc) from None

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self._after_send_failure(exc) from None

    def verdict(self) -> bytes:
        """The receiver's next verdict's payload; a refusal is a ReplicationError with its reason."""
        status, n = VERDICT.unpack(self._recv(VERDICT.size))
        payload = self._recv(n)
        if status != OK:
            reason = payload.decode("utf-8", "replace")
            refusal = ReplicationError(f"{self.what}: refused by the receiver at {self.where} at {self.stage}: "
                                       f"{reason}")
            refusal.refused = True
            raise refusal
        return payload

    def _after_send_failure(self, exc: OSError) -> ReplicationError:
        """The receiver may have refused and stopped reading: its reason, if it is there to read."""
        try:
            self.sock.settimeout(1.0)
            self.verdict()
        except ReplicationError as refusal:
            if getattr(refusal, "refused", False):
                return refusal
        except Exception:  # noqa: BLE001 - nothing to read: the send's own failure is the story
            pass
        return self._failed(exc)

    def hello(self, node: int, tag: str, count: int, total: int, manifest_len: int) -> None:
        self.stage = "its greeting"
        if self._recv(len(MAGIC_RECEIVER)) != MAGIC_RECEIVER:
            raise ReplicationError(f"{self.what}: the peer at {self.where} is not a pyckpt replica receiver")
        nonce_r = self.verdict()
        if len(nonce_r) != NONCE:
            raise ReplicationError(f"{self.what}: the greeting of the receiver at {self.where} is malformed")
        raw_tag = tag.encode("utf-8", "surrogateescape")
        nonce_s = os.urandom(NONCE)
        fields = FIELDS.pack(node, count, total, manifest_len, len(raw_tag))
        mac = _mac(self.token, LABEL_SENDER, nonce_r, nonce_s, fields, raw_tag)
        self.stage = "the hello"
        self.send(MAGIC_SENDER + nonce_s + mac + fields + raw_tag)
        proof = self.verdict()
        if not hmac.compare_digest(proof, _mac(self.token, LABEL_RECEIVER, nonce_s, nonce_r)):
            raise ReplicationError(f"{self.what}: the receiver at {self.where} did not prove it holds the job's "
                                   f"token; none of the checkpoint was sent")

    def manifest(self, data: bytes) -> None:
        self.stage = "the manifest"
        self.send(data)
        self.verdict()
        self.stage = "the data"

    def send_file(self, f: _File, crc: "concurrent.futures.Future") -> None:
        """``f``'s bytes by sendfile(2), then its CRC-32 (``crc``'s result, taken meanwhile by reading the
        file). The file must be the one listed, unchanged, once both are done: a change before that
        could have reached both reads alike, and a CRC of changed bytes would match them."""
        self.stage = f"the data ({f.name!r})"
        fd = _open(f)
        try:
            sent = 0
            if f.size:
                with os.fdopen(os.dup(fd), "rb", buffering=0) as fileobj:
                    try:
                        sent = self.sock.sendfile(fileobj, 0, f.size)  # the kernel moves the bytes
                    except OSError as exc:
                        raise self._after_send_failure(exc) from None
            value = crc.result()
            if sent != f.size or _identity(os.fstat(fd)) != f.identity:
                raise ReplicationError(f"{f.path}: changed while being replicated (its inode, size or modification "
                                       f"time); a checkpoint being replicated must not change")
        finally:
            os.close(fd)
        self.send(CRC.pack(value))

    def finish(self) -> None:
        self.stage = "the end of the data"
        self.send(END)
        self.verdict()


def manifest_bytes(entries) -> bytes:
    """The manifest of ``entries`` ((name, size) each), as the protocol sends it."""
    out = bytearray()
    for name, size in entries:
        raw = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else bytes(name)
        if len(raw) > 0xFFFF:
            raise ReplicationError(f"{name!r}: a name of {len(raw)} bytes cannot be sent")
        out += ENTRY.pack(len(raw), size) + raw
    return bytes(out)


def send_folder(tag_folder: str, node: int, tag: str, address: Tuple[str, int], token: bytes,
                timeout: float = 600.0) -> Sent:
    """Sends every regular file of ``tag_folder`` (not following links; a link or anything but regular
    files and folders is refused with a ReplicationError naming it) to the :class:`ReplicaReceiver` at
    ``address``, as node ``node``'s checkpoint ``tag``; returns once the receiver has verified every
    file's size and CRC-32 and published the replica. ``timeout``: seconds for connecting and for each
    send or receive. Raises :class:`~pyckpt.errors.ReplicationError` when the receiver refuses (its
    reason in the message), does not prove it holds ``token``, the connection fails, or a file changes
    while it is sent. Blocks the calling thread (run it in one of its own to keep training going)."""
    t0 = time.perf_counter()
    check_number("node", node, integer=True, low=0, high=MAX_NODE - 1)
    check_number("timeout", timeout, low=0, low_open=True)
    token = _check_token(token)
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, not {type(tag).__name__}")
    folder = os.path.abspath(os.fspath(tag_folder))
    files = _collect(folder)
    if not files:
        raise ReplicationError(f"{folder}: holds no files; there is nothing to replicate")
    manifest = manifest_bytes((f.name, f.size) for f in files)
    if len(manifest) > 0xFFFFFFFF or len(tag.encode("utf-8", "surrogateescape")) > 0xFFFF:
        raise ReplicationError(f"{folder}: its manifest or tag is too long to send")
    total = sum(f.size for f in files)
    what = f"replica of {folder} (node {node}, tag {tag!r})"
    with _Session(address, token, timeout, what) as session:
        session.hello(node, tag, len(files), total, len(manifest))
        session.manifest(manifest)
        # One thread reads each file for its CRC while the kernel sends it: the pass over the bytes
        # runs beside the transfer instead of before it.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pyckpt-replica-crc")
        try:
            buf = bytearray(CRC_CHUNK)
            crcs = [pool.submit(_file_crc, f, buf) for f in files]
            for f, crc in zip(files, crcs):
                session.send_file(f, crc)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        session.finish()
    return Sent(files=len(files), bytes=total, seconds=time.perf_counter() - t0)

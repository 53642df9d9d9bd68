"""The replica protocol: how one node's checkpoint folder is copied into a peer node's memory tier,
verified before it counts; its wire format, limits and the helpers both sides share.

A :class:`~.replica_receiver.ReplicaReceiver` runs on the node that keeps the replica: a background
thread accepts connections and writes what a peer sends into ``<job folder>/replica-of-node<N>/<tag>``.
:func:`~.replica_sender.send_folder` runs on the node whose files they are. Everything the receiver reads is
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
  folder published (:class:`~pyckpt.execution.publisher.Publisher`: one atomic rename, an older
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
* **Bounded, and the token first.** A connection proves the token before it takes anything a sender
  of the job needs: until its hello is checked it waits in a stage of its own (``max_waiting``
  connections; a newer one takes the place of the one that has waited longest), and its whole hello
  must arrive within ``hello_timeout`` (a few seconds) of the greeting. Only then does it take one of
  ``max_connections`` transfer slots (a further one is told the receiver is busy), one at a time per
  node (a second one for the same node is refused: two could interleave their ``latest``); from then
  on every receive waits at most ``timeout`` seconds. Idle or hostile connections, however many and
  however often they reconnect, so never hold a transfer's slot nor turn a sender away: a sender of
  the job answers the greeting at once and is in before its place is wanted (``max_waiting`` newer
  connections would have to arrive within that moment), and none of them holds its place longer than
  ``hello_timeout``. What a peer sends before it is known (the hello) is at most 64 KiB; the results
  kept are the last 1,000.

Nodes are numbered as torchrun numbers them; where replicas go (a ring, by default) is the caller's
policy, not this protocol's.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Optional

from ...errors import ReplicationError, printable
from ...execution.control_characters import first_control
from ...execution.tag_rule import tag_problem as checkpoint_tag_problem

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
MAX_TOKEN = 1 << 16
MIN_TOKEN = 16  # bytes: the job's token is meant to be os.urandom(32); a short one is guessable
MAX_RESULTS = 1000

# Receive, checksum and write in windows this big, one being received while the others are written:
# 1 GB over loopback into tmpfs took 0.65-0.73 s with 1 MiB windows, 0.50-0.63 s with 4 MiB (3 of
# them), no better with 8 or 16 MiB. 12 MiB per connection, at most max_connections of them.
CHUNK = 4 << 20
WINDOWS = 3
# What the sender reads at once to take a file's CRC while the kernel sends it.
CRC_CHUNK = 8 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
    bad = first_control(name)
    if bad:
        return f"contains the control character {bad!r}"
    return ""


def tag_problem(raw: bytes) -> str:
    """Why ``raw`` (a tag as received) cannot name a checkpoint's folder: the save's rule
    (:func:`~pyckpt.execution.tag_rule.tag_problem`), on its UTF-8."""
    try:
        tag = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not valid UTF-8"
    return checkpoint_tag_problem(tag)


def _shown(raw: bytes) -> str:
    text = repr(raw.decode("utf-8", "backslashreplace"))
    return text if len(text) <= 80 else text[:77] + "..."


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


def manifest_bytes(entries) -> bytes:
    """The manifest of ``entries`` ((name, size) each), as the protocol sends it."""
    out = bytearray()
    for name, size in entries:
        raw = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else bytes(name)
        if len(raw) > 0xFFFF:
            raise ReplicationError(f"{name!r}: a name of {len(raw)} bytes cannot be sent")
        out += ENTRY.pack(len(raw), size) + raw
    return bytes(out)

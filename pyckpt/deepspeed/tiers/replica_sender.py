"""The sending side of the replica protocol (:mod:`.replica_protocol`): :func:`send_folder` copies one
node's checkpoint folder to a peer's :class:`~.replica_receiver.ReplicaReceiver`, the kernel moving the
bytes (sendfile(2)) while a second thread takes each file's CRC-32.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import os
import socket
import time
from dataclasses import dataclass
from typing import List, Tuple

from ...errors import ReplicationError, check_number
from .folder_walk import tag_files
from .node_manifest import fd_crc
from .replica_protocol import (CRC, CRC_CHUNK, END, FIELDS, LABEL_RECEIVER, LABEL_SENDER, MAGIC_RECEIVER,
                               MAGIC_SENDER, MAX_FILES, MAX_NODE, NONCE, OK, VERDICT, Sent, _check_token, _Closed,
                               _mac, _no_delay, _recv_exact, manifest_bytes)


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
        crc, done = fd_crc(fd, f.size, memoryview(buf))
    finally:
        os.close(fd)
    if done < f.size:
        raise ReplicationError(f"{f.path}: shrank from {f.size} to {done} bytes while being replicated")
    return crc


def _collect(tag_folder: str) -> List[_File]:
    """Every file of ``tag_folder``, sorted by name. Only regular files count, and only the folder's
    own: a receiver takes plain file names, so a sub-folder is refused here, before anything is sent,
    as is a link (not followed) or anything else, each a ReplicationError naming it. The folder is
    sent as it is, its manifest among its files: what it holds is the receiver's to check."""
    root = os.path.abspath(os.fspath(tag_folder))
    listed = tag_files(root, depth=0, error=ReplicationError, what="the folder to replicate",
                       folders="a replica holds only the tag folder's own files (a receiver takes plain file names, "
                               "no folders)")
    if len(listed) > MAX_FILES:
        raise ReplicationError(f"{root}: more than {MAX_FILES} files; a receiver takes at most that many")
    return [_File(f.name, f.path, f.stat.st_size, _identity(f.stat)) for f in listed]


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


def send_folder(tag_folder: str, node: int, tag: str, address: Tuple[str, int], token: bytes,
                timeout: float = 600.0) -> Sent:
    """Sends every file of ``tag_folder`` (regular files only: a sub-folder, a link or anything else is
    refused with a ReplicationError naming it, before anything is sent) to the :class:`ReplicaReceiver` at
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

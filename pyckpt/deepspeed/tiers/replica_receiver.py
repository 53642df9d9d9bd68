"""The receiving side of the replica protocol (:mod:`.replica_protocol`): a :class:`ReplicaReceiver`
runs on the node that keeps a peer's replica, checks everything a sender says before it writes, and
publishes a replica only once every file's size and CRC-32 matched.

One module, longer than most: admission, the manifest's checks, the streamed write and the publish are
the steps of one transfer whose state each step checks; apart, a reader could not see what a sender
can make the receiver do.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hmac
import os
import selectors
import socket
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from ...errors import check_number, printable
from ...execution.leftovers import clean_orphans
from ...execution.publisher import Publisher
from ...native import _core
from . import free_slot
from .folder_names import replica_folder
from .memory_root import MODE, Budget, _check, _open_level, fits
from .replica_protocol import (_DIR_FLAGS, CHUNK, CRC, END, ENTRY, FIELDS, HELLO, LABEL_RECEIVER, LABEL_SENDER,
                               MAGIC_RECEIVER, MAGIC_SENDER, MAX_FILES, MAX_NODE, MAX_RESULTS, NAME_MAX, NONCE, OK,
                               REFUSED, WINDOWS, Received, _check_token, _Closed, _mac, _no_delay,
                               _reason, _recv_exact, _Refusal, _shown, _verdict, name_problem, tag_problem)

_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# a free slot's file, moved into the staging folder (a regular file with one link, checked there)
_REUSE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _free_bytes(fd: int) -> int:
    """Bytes free to us on the filesystem of the folder ``fd`` (statvfs)."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


class ReplicaReceiver:
    """Receives one peer node's checkpoint folders into ``<node folder>/replica-of-node<N>/<tag>``, in a
    background thread.

    ``node_folder``: this node's folder of the job in the memory tier (a real folder of ours that
    nobody else may write to: refused with :class:`~pyckpt.errors.MemoryRootError` otherwise);
    ``replica-of-node<N>`` is made in it, mode 0700, when a replica of node N first arrives. ``token``:
    the job's secret (16 bytes or more). ``host``/``port``: where to listen (port 0: any free one; see
    :attr:`address`). ``max_bytes``: the most one replica may hold, or None. ``timeout``: seconds any
    receive of a known sender may wait. ``max_connections``: transfers at once, each of a sender that
    proved it holds the token. ``hello_timeout``: seconds a connection has for its whole hello (the proof)
    after the greeting. ``max_waiting``: connections at once that have not yet proven it; a new one
    beyond it takes the place of the one that has waited longest.

    Admission is in two stages so that connections which never prove the token cannot keep one that does
    out: they wait in their own bounded stage, each for ``hello_timeout`` at most, and never take a
    transfer's slot; and a connection arriving when that stage is full drops the oldest waiting one
    instead of being turned away. A sender of the job answers the greeting at once, so a flood would have
    to open ``max_waiting`` connections within that moment to push it out: idle or hostile connections,
    however many and however often they reconnect, do not make a replica wait for them.

    The protocol, and what is checked, are in :mod:`.replica_protocol`'s docstring. Use it as a context manager, or
    call :meth:`start` and :meth:`close`. ``on_published(replica folder)`` runs after each replica
    is published (the owner's retention), ``before_receive(replica folder)`` before its data flows (the
    owner's retention before it: a replica that leaves the tier may become the folder's free slot); what
    either raises is ignored. A file of the replica folder's free slot with the name of one received
    is written over in place (:mod:`.free_slot`: the same tmpfs pages every replica).
    """

    def __init__(self, node_folder: str, token: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_bytes: Optional[int] = None, *, timeout: float = 60.0, max_connections: int = 8,
                 hello_timeout: float = 5.0, max_waiting: int = 64,
                 on_published: Optional[Callable[[str], None]] = None,
                 before_receive: Optional[Callable[[str], None]] = None):
        self._token = _check_token(token)
        if max_bytes is not None:
            check_number("max_bytes", max_bytes, integer=True, low=0)
        check_number("timeout", timeout, low=0, low_open=True)
        check_number("max_connections", max_connections, integer=True, low=1, high=1024)
        check_number("hello_timeout", hello_timeout, low=0, low_open=True)
        check_number("max_waiting", max_waiting, integer=True, low=1, high=1024)
        self.max_bytes = max_bytes
        self.timeout = float(timeout)
        self.max_connections = max_connections
        self.hello_timeout = float(hello_timeout)
        self.max_waiting = max_waiting
        self.on_published = on_published
        self.before_receive = before_receive
        self.node_folder = os.path.abspath(os.fspath(node_folder))
        self._node_fd = _open_node_folder(self.node_folder)
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family,
                                                  backlog=max(16, 2 * (max_connections + max_waiting)))
            self._listener.setblocking(False)
        except BaseException:
            os.close(self._node_fd)
            raise
        self._address = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._active: Dict[threading.Thread, socket.socket] = {}  # every connection being served
        # the connections that have not proven the token yet, oldest first; the ones dropped for newer ones
        self._waiting: "collections.OrderedDict[threading.Thread, socket.socket]" = collections.OrderedDict()
        self._dropped: set = set()
        self._transfers = 0  # connections that proved it: at most max_connections
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
        os.close(self._node_fd)
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
        dropped = None
        with self._lock:
            closing = self._closing
            if not closing:
                if len(self._waiting) >= self.max_waiting:  # the longest-waiting unknown peer makes room
                    oldest, dropped = self._waiting.popitem(last=False)
                    self._dropped.add(oldest)
                thread = threading.Thread(target=self._serve, args=(conn, peer), name="pyckpt-replica-receive",
                                          daemon=True)
                self._active[thread] = conn
                self._waiting[thread] = conn
        if dropped is not None:
            with contextlib.suppress(OSError):
                dropped.shutdown(socket.SHUT_RDWR)  # wakes its receive; its worker records why and leaves
        if closing:
            try:
                conn.settimeout(1.0)  # the greeting is the first thing on the connection: it fits the buffer
                conn.sendall(MAGIC_RECEIVER + _verdict(REFUSED, _reason("the receiver is closing")))
            except OSError:
                pass
            conn.close()
            self._record(Received(peer, None, None, 0, 0, False, f"{peer}: the receiver is closing"))
            return
        thread.start()

    def _record(self, result: Received) -> None:
        with self._lock:
            self._results.append(result)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        state = _Transfer(peer)
        me = threading.current_thread()
        try:
            conn.settimeout(self.hello_timeout)
            self._transfer(conn, state)
        except _Refusal as exc:
            state.error = exc.reason
            _refuse(conn, exc)
        except socket.timeout:
            state.error = (f"no data from the sender for {self.timeout:g} s; the connection was dropped"
                           if state.known else
                           f"no complete hello within {self.hello_timeout:g} s of the greeting; the connection "
                           f"was dropped")
        except (_Closed, ConnectionError, OSError) as exc:
            if self._closing:
                state.error = "the receiver was closed during the transfer"
            elif me in self._dropped:
                state.error = (f"dropped {state.stage}: {self.max_waiting} connections were waiting to prove the "
                               f"job's token, this one the longest, when another came")
            elif isinstance(exc, (_Closed, ConnectionError)):
                state.error = f"the sender closed the connection {state.stage}" + (f" {exc}" if str(exc) else "")
            else:
                state.error = f"the transfer failed {state.stage} ({exc.strerror or exc})"
        except Exception as exc:  # noqa: BLE001 - one connection must never stop the receiver
            state.error = f"the transfer failed {state.stage} ({type(exc).__name__}: {exc})"
        finally:
            try:
                conn.close()
            finally:
                with self._lock:  # all at once: whoever sees the slot free sees the result too
                    self._active.pop(me, None)
                    self._waiting.pop(me, None)
                    self._dropped.discard(me)
                    if state.holds_transfer:
                        self._transfers -= 1
                    if state.holds_node:
                        self._receiving.discard(state.node)
                    if not state.recorded:
                        self._results.append(state.result())

    def _known(self, state: "_Transfer") -> None:
        """The connection proved the token: from the waiting stage to a transfer's slot, if one is free."""
        me = threading.current_thread()
        with self._lock:
            if self._waiting.pop(me, None) is None:  # dropped for a newer connection just now
                raise _Closed("")
            if self._transfers >= self.max_connections:
                raise _Refusal(f"the receiver is busy: {self.max_connections} transfers in progress, the most it "
                               f"takes at once")
            self._transfers += 1
            state.holds_transfer = True

    def _transfer(self, conn: socket.socket, state: "_Transfer") -> None:
        nonce_r = os.urandom(NONCE)
        # An unknown peer gets hello_timeout for the greeting and its whole hello, not per byte: it cannot
        # hold its place by trickling, nor a transfer's slot at all.
        deadline = time.monotonic() + self.hello_timeout
        state.stage = "before its hello was complete"
        conn.sendall(MAGIC_RECEIVER + _verdict(OK, nonce_r))
        fixed = _recv_exact(conn, HELLO.size, deadline)
        magic, nonce_s, mac_s, node, count, total, manifest_len, tag_len = HELLO.unpack(fixed)
        if magic != MAGIC_SENDER:
            raise _Refusal("the hello does not start with pyckpt's replica magic: not a pyckpt replica sender")
        raw_tag = _recv_exact(conn, tag_len, deadline)
        want = _mac(self._token, LABEL_SENDER, nonce_r, nonce_s, fixed[HELLO.size - FIELDS.size:], raw_tag)
        if not hmac.compare_digest(mac_s, want):
            raise _Refusal("the hello's HMAC does not match the job's token: the sender is not one of the job's ranks")
        state.authenticated(node, raw_tag)
        self._known(state)
        conn.settimeout(self.timeout)
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
        too_big = fits(total, Budget(free=_free_bytes(self._node_fd), limit=None, used=0))
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
        # The node's slot and the result go before the sender hears: the next replica of that node may
        # follow at once (a sender's next checkpoint), and must not find the slot still taken.
        with self._lock:
            self._receiving.discard(node)
            state.holds_node = False
            self._results.append(state.result())
            state.recorded = True
        try:
            conn.sendall(_verdict(OK, b"published"))
        except OSError:
            pass  # verified and published: the replica counts whether or not the sender hears so

    def _write_replica(self, conn: socket.socket, state: "_Transfer", files: List[Tuple[str, int]],
                       total: int) -> None:
        name = replica_folder(state.node)
        path = os.path.join(self.node_folder, name)
        output = os.path.join(path, state.tag)
        with contextlib.ExitStack() as stack:
            try:
                os.close(_open_level(self._node_fd, name, path, "the replica folder", True))  # made 0700, checked
                # what a receiver killed mid-transfer left (its staging, of any tag: tmpfs pages are memory)
                clean_orphans(path)
                out = stack.enter_context(Publisher(output, overwrite=True, pointer="latest"))
                staging_fd = os.open(out.staging, _DIR_FLAGS)
            except OSError as exc:
                raise _Refusal(f"the replica cannot be staged here: {exc.strerror or exc}") from None
            try:
                os.fchmod(staging_fd, MODE)
                if self.before_receive is not None:
                    try:
                        self.before_receive(path)
                    except Exception:  # noqa: BLE001
                        pass
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
                    reused = free_slot.take(path, out.staging, os.path.join(out.staging, fname))
                    got = _receive_file(conn, staging_fd, fname, size, writer, reused)
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
        if self.on_published is not None:
            try:  # the owner's retention of this node's replicas; the replica counts whatever it does
                self.on_published(path)
            except Exception:  # noqa: BLE001
                pass


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
        self.holds_transfer = False  # it proved the token and holds one of the max_connections slots
        self.known = False  # it proved the token
        self.recorded = False  # its result is in the receiver's results already

    def authenticated(self, node: int, raw_tag: bytes) -> None:
        self.known = True
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


def _open_node_folder(path: str) -> int:
    what = "the node's memory folder"
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


def _receive_file(conn: socket.socket, dir_fd: int, name: str, size: int, writer: _Writer,
                  reused: bool = False) -> int:
    """Receives ``size`` bytes into the new file ``name`` in ``dir_fd`` (``reused``: the free slot's file
    moved there, written over and cut to size); returns their CRC-32, taken from the very bytes handed
    to write(2)."""
    fd = os.open(name, _REUSE_FLAGS if reused else _FILE_FLAGS, 0o600, dir_fd=dir_fd)
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
            if reused:
                os.ftruncate(fd, size)
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

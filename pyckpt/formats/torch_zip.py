"""Opening torch.save files: the native reader maps the ZIP, the safe unpickler reads data.pkl.

Only the small pickle is read here; tensors come back as references whose bytes stay on disk until
the executor copies them.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import stat
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

from ..errors import CheckpointFormatError
from ..native import _core, native_errors, scan_pickle
from .pickle_read import StorageRef, TensorRef, loads_with_storages

# data.pkl holds only structure (names, shapes, small scalars): a few MB even for models with
# hundreds of thousands of parameters. A larger one is refused before it is read into memory, as
# safetensors caps its header; PYCKPT_MAX_PICKLE_BYTES raises the cap for an exotic checkpoint.
DEFAULT_MAX_PICKLE_BYTES = 256 << 20

# Records torch.save writes beside data.pkl and torch.load parses: (name, rule, test of the bytes).
METADATA_RECORDS = (
    ("version", "a decimal version number", lambda b: b.strip().isdigit() and b.isascii()),
    (".data/version", "a decimal version number", lambda b: b.strip().isdigit() and b.isascii()),
    (".format_version", "a decimal version number", lambda b: b.strip().isdigit() and b.isascii()),
    (".storage_alignment", "a decimal alignment", lambda b: b.strip().isdigit() and b.isascii()),
    ("byteorder", "'little' or 'big'", lambda b: b in (b"little", b"big")),
    (".data/serialization_id", "ASCII text", lambda b: b.isascii()),
)

def _members_digest(size: int, prefix: str, members: Dict[str, Tuple[int, int, int]]) -> int:
    """What a re-read in this process must find again, in one 64-bit number: the member table in
    the order the file lists it. A collision needs a file crafted against this process's string
    hashing, and a file crafted to collide still passes every check a first read makes; hashing
    the values as they are (no text, no sort) keeps it a small part of reading 15,000 files."""
    return hash((size, prefix, tuple(members.items())))


def max_pickle_bytes() -> int:
    value = os.environ.get("PYCKPT_MAX_PICKLE_BYTES")
    return int(value) if value else DEFAULT_MAX_PICKLE_BYTES


class SourceFile:
    """One input torch.save archive: its member table and its parsed pickle.

    ``head`` is the file's entry from ``_core.read_archive_heads`` (see :func:`iter_sources`), which
    read the member table and data.pkl already; without it the file is opened here."""

    # One per rank file of a checkpoint, held for the whole plan: no per-instance dict, and the path
    # kept as its folder (one string for all the files in it) and its name (the folder listing's
    # string where iter_sources is given one).
    __slots__ = ("_dir", "_name", "size", "_prefix", "_members", "_members_digest", "_pickle_bytes", "_obj",
                 "_loaded", "_scan")

    def __init__(self, path: str, head=None):
        path = os.fspath(path)
        cut = path.rfind("/") + 1
        self._dir, self._name = sys.intern(path[:cut]), path[cut:]
        if head is None:
            head = self._read_head()
        self.size, self._prefix, self._members, self._pickle_bytes = head
        self._members_digest = None  # set while the member table is let go (release)
        pkl = self.prefix + "/data.pkl"
        if pkl not in self.members:
            raise CheckpointFormatError(f"{self.path}: not a torch.save archive (no {pkl} member)")
        cap = max_pickle_bytes()
        if self.members[pkl][1] > cap or self._pickle_bytes is None:
            raise CheckpointFormatError(f"{self.path}: {pkl} is {self.members[pkl][1]} bytes, more than the "
                                        f"{cap}-byte cap for checkpoint metadata (set PYCKPT_MAX_PICKLE_BYTES "
                                        "to raise it)")
        self._obj = None
        self._loaded = False
        self._scan = None

    def _read_head(self):
        # A clear refusal of FIFOs and folders here; the native reader refuses them too (without
        # blocking), in case the name is swapped between the two opens.
        os.close(open_regular(self.path))
        try:
            with native_errors(), _core.Archive(self.path) as ar:
                members: Dict[str, Tuple[int, int, int]] = {
                    name: (off, size, crc) for name, off, size, crc in ar.members()
                }
                pkl = ar.prefix + "/data.pkl"
                small = pkl in members and members[pkl][1] <= max_pickle_bytes()
                return ar.size, ar.prefix, members, ar.read(pkl) if small else None
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self.path}: file not found") from None

    @property
    def path(self) -> str:
        return self._dir + self._name

    @property
    def prefix(self) -> str:
        """The folder name every member sits under (torch.save's archive name), read again if let go."""
        if self._prefix is None:
            self._reread()
        return self._prefix

    @property
    def members(self) -> Dict[str, Tuple[int, int, int]]:
        """Member name -> (absolute data offset, size, CRC-32), read again if it was let go."""
        if self._members is None:
            self._reread()
        return self._members

    def release(self) -> None:
        """Let go of the parsed pickle, its bytes, the member table and its prefix. A planner reading thousands
        of files (one per rank, one per AutoEP expert) keeps the records it took from each, not
        every file's whole object: the member table alone was 2.4 KB a file, the largest per-rank
        cost of a 4,096-rank plan. A later load() or members reads the file again, and refuses it if
        its records changed; storage offsets already checked stay known."""
        if self._members is not None:
            self._members_digest = _members_digest(self.size, self.prefix, self._members)
        self._obj, self._loaded, self._scan, self._pickle_bytes, self._members = None, False, None, None, None
        self._prefix = None

    def _reread(self) -> None:
        size, prefix, members, data = self._read_head()
        if self._members is None:
            same = _members_digest(size, prefix, members) == self._members_digest
        else:
            same = (size, prefix, members) == (self.size, self.prefix, self._members)
        if not same or data is None:
            raise CheckpointFormatError(f"{self.path}: changed while pyckpt was reading it (its records differ from "
                                        "when it was first opened)")
        self._members, self._members_digest, self._prefix = members, None, prefix
        self._pickle_bytes = data

    def _pickle_scan(self):
        """The native opcode walk over data.pkl (native.scan_pickle), made once and shared by load()
        and check_copyable()."""
        if self._scan is None:
            if self._pickle_bytes is None:
                self._reread()
            self._scan = scan_pickle(self._pickle_bytes)
        return self._scan

    def load(self) -> Any:
        """The unpickled top-level object (parsed once, tensors as TensorRef).

        Every storage the pickle names is checked against its record here, so a file that parses
        has no tensor reaching outside its bytes, whether pyckpt later reads it or copies it whole."""
        if not self._loaded:
            if self._pickle_bytes is None:
                self._reread()
            obj, storages = loads_with_storages(self._pickle_bytes, source=self, where=self.path,
                                                scan=self._pickle_scan())
            for storage in storages.values():
                self.storage_offset(storage)
            self._obj = obj
            self._loaded = True
        return self._obj

    def check_copyable(self) -> None:
        """Refuse a pickle that parses here but that torch's own weights-only loader would refuse.

        A file copied verbatim (model states) must load downstream as it did here. torch.save writes
        protocol 2 with a fixed set of opcodes, and torch.load(weights_only=True) reads only those;
        the allowlist reader above is CPython's unpickler and takes any opcode, so a crafted
        SHORT_BINBYTES (say) would otherwise pass through into the output. The allowlist is
        native.TORCH_SAVE_OPCODES, checked by the same native walk that guards load()."""
        scan = self._pickle_scan()
        pos = scan.disallowed_at
        if pos >= 0:
            if scan.disallowed_opcode is None:  # load() refuses this first; here for callers that skip it
                raise CheckpointFormatError(f"{self.path}: data.pkl has byte 0x{self._pickle_bytes[pos]:02x} at byte "
                                            f"{pos}, which is no pickle opcode: corrupt pickle")
            raise CheckpointFormatError(f"{self.path}: data.pkl uses pickle opcode {scan.disallowed_opcode} (at byte "
                                        f"{pos}), which torch.save never writes and torch.load(weights_only=True) "
                                        "refuses")
        # torch.load parses these small records itself (a version number, the byte order, an id); a
        # value it cannot parse fails the load of the copy.
        for record, rule, ok in METADATA_RECORDS:
            entry = self.members.get(f"{self.prefix}/{record}")
            if entry is None:
                continue
            off, size, _ = entry
            if size > 64 or not ok(self.read_bytes(off, size)):
                raise CheckpointFormatError(f"{self.path}: record {self.prefix}/{record} is not {rule} "
                                            f"({size} bytes), so torch.load would refuse the file")

    def storage_offset(self, storage: StorageRef) -> int:
        """Absolute byte offset of a storage record's data, checked against the record's size."""
        # A file's storages are checked when it is loaded and looked up again for every fragment
        # planned from them; the reader makes one StorageRef per record, so a record that passed
        # for it passes again. The offset is kept on the record, not in a table per file: a
        # 4,096-rank plan holds every rank file.
        if storage.source is self and storage.file_offset is not None:
            return storage.file_offset
        name = f"{self.prefix}/data/{storage.key}"
        entry = self.members.get(name)
        if entry is None:
            raise CheckpointFormatError(f"{self.path}: the pickle names storage record {name}, which is missing "
                                        "(truncated or corrupt file)")
        off, size, _ = entry
        if size < storage.nbytes:
            raise CheckpointFormatError(f"{self.path}: record {name} holds {size} bytes but its tensor needs "
                                        f"{storage.nbytes}")
        if storage.source is self:
            storage.file_offset = off
        return off

    def tensor_byte_range(self, t: TensorRef, start: int = 0, numel: int = None) -> Tuple[int, int]:
        """(absolute offset, nbytes) of elements [start, start+numel) of a contiguous tensor."""
        count = t.numel()
        if numel is None:
            numel = count - start
        if not t.is_contiguous():
            raise CheckpointFormatError(f"{self.path}: expected a contiguous tensor, got {t!r}")
        if start < 0 or numel < 0 or start + numel > count:
            raise CheckpointFormatError(f"{self.path}: slice [{start}, {start + numel}) is outside tensor {t!r} "
                                        f"of {count} elements")
        if (t.offset + count) > t.storage.numel:
            raise CheckpointFormatError(f"{self.path}: tensor {t!r} reaches past its storage of "
                                        f"{t.storage.numel} elements")
        base = self.storage_offset(t.storage)
        return base + (t.offset + start) * t.itemsize, numel * t.itemsize

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise CheckpointFormatError(f"{self.path}: byte range [{offset}, {offset + nbytes}) is outside the "
                                        f"{self.size}-byte file")
        fd = open_regular(self.path)
        try:
            data = os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)
        if len(data) != nbytes:
            raise CheckpointFormatError(f"{self.path}: the file shrank while being read (wanted {nbytes} bytes at "
                                        f"offset {offset})")
        return data

    def __repr__(self):
        return f"SourceFile({self.path!r})"


def iter_sources(paths, workers: int = 0, folder: Optional[str] = None) -> Iterator[SourceFile]:
    """``SourceFile(p)`` for every path, in order, the archives opened and indexed on native threads;
    with ``folder``, ``paths`` are names in it (a listing's strings, which the files then keep).

    Planning at frontier scale reads tens of thousands of files' metadata; this leaves the calling
    thread only the unpickling. Reads go in chunks so that the pickles waiting for the parser stay
    a bounded amount of memory (two chunks; the paths of a chunk are made when it is read), and the
    next chunk is read while the caller parses this one: on a DeepSeek-V3-shaped checkpoint the
    14,848 expert files took as long to open as to parse. A file the batch could not read is opened
    alone when its turn comes, so its refusal is the one ``SourceFile`` gives, after every file
    before it."""
    items = paths if isinstance(paths, (list, tuple)) else list(paths)
    chunks = [items[lo:lo + _HEAD_CHUNK] for lo in range(0, len(items), _HEAD_CHUNK)]
    cap = max_pickle_bytes()

    def full(item) -> str:
        return os.path.join(folder, item) if folder is not None else os.fspath(item)

    def read(chunk):
        return _core.read_archive_heads([full(item) for item in chunk], "data.pkl", cap, workers)

    def opened(item, head) -> SourceFile:
        sf = SourceFile(full(item), head)
        if folder is not None and sf._name == item:
            sf._name = item  # the listing's string, not a copy
        return sf

    if len(chunks) <= 1:
        for chunk in chunks:
            yield from (opened(item, head) for item, head in zip(chunk, read(chunk)))
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pyckpt-heads") as pool:
        pending = pool.submit(read, chunks[0])
        for i, chunk in enumerate(chunks):
            heads = pending.result()
            pending = pool.submit(read, chunks[i + 1]) if i + 1 < len(chunks) else None
            for item, head in zip(chunk, heads):
                yield opened(item, head)


# Two chunks of heads (member tables and pickles) are in memory at once: at 1,024 files a chunk they
# were a third of a 4,096-rank plan's peak RSS (51 MiB); at 256 the peak is 10 MiB lower and the
# reads take as long.
_HEAD_CHUNK = 256


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, refusing anything but a regular file.

    O_NONBLOCK keeps a FIFO planted under a checkpoint's name from blocking the open forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: file not found") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link naming itself, or too long a chain: not a file at all
            raise CheckpointFormatError(f"{path}: a link in a loop (or a chain of more than 40), not a regular "
                                        "file") from None
        raise
    return regular_fd(fd, path)


def regular_fd(fd: int, path: str, check=None) -> int:
    """``fd`` made blocking once it is known to be a regular file (and passes ``check(fd)``); closed
    and refused otherwise."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{path}: {file_kind(st.st_mode)}, not a regular file")
        if check is not None:
            check(fd)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {kind}"
    return "is a special file"


def read_capped(fd: int, path: str, limit: int, expected: str = "") -> bytes:
    """All of open file ``fd`` (closed here), refused past ``limit`` bytes without reading more."""
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise CheckpointFormatError(f"{path}: more than {limit} bytes" + (f"; expected {expected}" if expected else ""))
    return b"".join(chunks)

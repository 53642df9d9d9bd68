"""What one node's share of a memory checkpoint is: the file its node leader writes beside DeepSpeed's.

On several nodes each node's memory folder holds only the files its own ranks wrote (the model-state
file of model-parallel rank 0 is on one node only), so a node's tag folder cannot say by itself which
checkpoint it belongs to, nor whether it is whole. Its leader therefore adds ``pyckpt-node.json``
before publishing it: the save it belongs to (an id drawn once per save by rank 0, the same on every
node), the job, its run and the real path of its save dir (:mod:`.job_identity`), the step, this node's
number, how many nodes and ranks saved, a digest of the model's parameter names and shapes, and every
file with its size and the CRC-32 of its bytes. A replica carries the file along, so whichever node
holds a node's files, they say whose they are; recovery puts a checkpoint together only from shares
of one save (never of two saves of one step) of its own job's run, only when every node's share is
there, each file at its size, and only after each file's bytes gave the CRC-32 recorded at the save
(:mod:`.recovery`). The step a share claims counts only where the model-state file it holds says the
same.

The file is pyckpt's, not DeepSpeed's: a persisted or recovered checkpoint leaves it out.
Everything in it is untrusted when read: the strict JSON reader, every field's type and range, file
names confined to the tag folder.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ...errors import CheckpointFormatError, quoted
from ...execution.control_characters import first_control
from ...execution.tag_rule import tag_problem
from ...formats.json_file import read_json_object
from ...native import _core
from .folder_names import MANIFEST, is_replica_folder, job_name_problem, tag_reserved
from .folder_walk import TagFile, named_files, tag_files
from .job_identity import run_problem, save_dir_problem

NAME = MANIFEST
# 2: the run, the save dir and a CRC-32 per file; a share of version 1 names none of them and is
# nobody's to recover
VERSION = 2
# 15,000 expert files of ~100 bytes each are 1.5 MB; a node's share never comes near this
MAX_BYTES = 64 * 1024 * 1024
MAX_FILES = 1_000_000
_ID = re.compile(r"[A-Za-z0-9._-]{1,200}\Z")
_HEX = re.compile(r"[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class NodeManifest:
    save: str  # the save's id: the same on every node's share of one save, another for every save
    job: str
    tag: str
    step: int
    node: int  # the node whose ranks wrote these files
    nodes: int  # how many nodes saved
    world_size: int
    ranks: Tuple[int, int]  # first rank and rank count of this node
    model: str  # sha-256 of the model's parameter names and shapes
    # (name relative to the tag folder, size, CRC-32 of its bytes) of every file but this one
    files: Tuple[Tuple[str, int, int], ...]
    run: str  # the job's run (:mod:`.job_identity`)
    save_dir: str  # the real path of the save dir the checkpoint belongs to

    def key(self) -> tuple:
        """What every share of one checkpoint has in common."""
        return (self.save, self.job, self.tag, self.step, self.nodes, self.world_size, self.model, self.run,
                self.save_dir)

    def to_json(self) -> bytes:
        body = {"pyckpt_node_manifest": VERSION, "save": self.save, "job": self.job, "tag": self.tag,
                "step": self.step, "node": self.node, "nodes": self.nodes, "world_size": self.world_size,
                "ranks": list(self.ranks), "model": self.model, "files": [list(f) for f in self.files],
                "run": self.run, "save_dir": self.save_dir}
        return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()


def model_digest(engine) -> str:
    """A digest of ``engine``'s parameter names and full shapes (ZeRO-3's partitioned parameters by
    their ``ds_shape``): the same on every rank of one model."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        h.update(f"{name}\0{shape}\0{bool(p.requires_grad)}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


# what one thread reads at once to take a file's CRC-32
CRC_CHUNK = 8 << 20


def fd_crc(fd: int, size: int, view: memoryview) -> Tuple[int, int]:
    """(CRC-32, bytes read) of the first ``size`` bytes of the open file ``fd``, read with read(2)
    through ``view`` (a mapping of a file that shrank would kill the process); fewer bytes where the
    file ends sooner, which its caller refuses."""
    crc = 0
    done = 0
    while done < size:
        n = os.readv(fd, [view[:min(len(view), size - done)]])
        if n == 0:
            break
        crc = _core.crc32(view[:n], crc)
        done += n
    return crc, done


def file_crc(path: str, size: Optional[int] = None, buf: Optional[bytearray] = None) -> Tuple[int, os.stat_result]:
    """(CRC-32 of the regular file ``path``, its fstat), read with read(2) (a mapping of a file that
    shrank would kill the process) without following a link. With ``size``, a file of another size
    is a CheckpointFormatError, as is anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(f"{path}: not a regular file")
        want = st.st_size if size is None else size
        if st.st_size != want:
            raise CheckpointFormatError(f"{path}: {st.st_size} bytes, the manifest records {want}")
        view = memoryview(buf if buf is not None else bytearray(min(CRC_CHUNK, max(want, 1))))
        crc, done = fd_crc(fd, want, view)
        if done < want:
            raise CheckpointFormatError(f"{path}: shrank to {done} bytes while being read")
    finally:
        os.close(fd)
    return crc, st


def crcs(paths: Sequence[Tuple[str, Optional[int]]]) -> List[Tuple[int, os.stat_result]]:
    """:func:`file_crc` of each ``(path, size)``, a few files at once (the CRC and the reads release the
    GIL), in order; the first failure raised."""
    if len(paths) < 2:
        return [file_crc(p, size) for p, size in paths]
    workers = min(4, len(paths), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pyckpt-crc") as pool:
        return list(pool.map(lambda item: file_crc(*item), paths))


def describe(folder: str, known: Optional[dict] = None) -> List[Tuple[str, int, int]]:
    """(name, size, CRC-32) of every file :func:`list_files` lists in ``folder``: what a manifest records.
    ``known``: {name: (size, CRC-32)} of files whose writer computed the CRC as it wrote them; those
    are taken as they are where the file has that size, the others read."""
    known = known or {}
    listed = list_files(folder)
    unread = [(name, size) for name, size in listed if known.get(name, (None, ))[0] != size]
    found = dict(zip((name for name, _ in unread), crcs([(os.path.join(folder, n), size) for n, size in unread])))
    return [(name, size, found[name][0] if name in found else known[name][1]) for name, size in listed]


def list_files(folder: str) -> List[Tuple[str, int]]:
    """(name, size) of every regular file under ``folder`` (sub-folders by ``a/b``) but the manifest,
    sorted; a link or anything but regular files and folders is a CheckpointFormatError (a save writes
    none), as is a folder nested deeper than a tag folder's (:func:`.folder_walk.tag_files`)."""
    return [(f.name, f.stat.st_size) for f in tag_files(folder) if f.name != NAME]


def write(folder: str, manifest: NodeManifest) -> None:
    """``manifest`` as ``folder/pyckpt-node.json`` (a new file: the tag folder is still staging)."""
    fd = os.open(os.path.join(folder, NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(manifest.to_json())


def _int(body: dict, key: str, low: int, high: int, where: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CheckpointFormatError(f"{where}: {key} is {quoted(value)}, not an integer from {low} to {high}")
    return value


def _name_ok(name: object) -> bool:
    if not isinstance(name, str) or not 0 < len(name) <= 4096 or first_control(name):
        return False
    parts = name.split("/")
    return all(p and p not in (".", "..") and len(p.encode("utf-8", "surrogateescape")) <= 255 for p in parts) \
        and name != NAME


def parse(data: dict, where: str) -> NodeManifest:
    """The manifest in ``data`` (the file's JSON object), every field checked; else CheckpointFormatError."""
    if data.get("pyckpt_node_manifest") != VERSION:
        raise CheckpointFormatError(f"{where}: not a version {VERSION} pyckpt node manifest")
    save = data.get("save")
    if not isinstance(save, str) or not _ID.match(save) or save.startswith("."):
        raise CheckpointFormatError(f"{where}: save is not one plain name")
    for key, rule in (("job", job_name_problem), ("tag", tag_problem)):
        problem = rule(data.get(key)) if isinstance(data.get(key), str) else "is not a string"
        if problem:
            raise CheckpointFormatError(f"{where}: {key} {quoted(data.get(key))} {problem}")
    step = _int(data, "step", 0, 2 ** 63 - 1, where)
    nodes = _int(data, "nodes", 1, 1 << 20, where)
    node = _int(data, "node", 0, nodes - 1, where)
    world = _int(data, "world_size", nodes, 1 << 24, where)
    ranks = data.get("ranks")
    if (not isinstance(ranks, list) or len(ranks) != 2 or any(isinstance(r, bool) or not isinstance(r, int)
                                                              for r in ranks)
            or not (0 <= ranks[0] and 1 <= ranks[1] and ranks[0] + ranks[1] <= world)):
        raise CheckpointFormatError(f"{where}: ranks is {quoted(ranks)}, not [first rank, count] within the world size")
    model = data.get("model")
    if not isinstance(model, str) or not _HEX.match(model):
        raise CheckpointFormatError(f"{where}: model is not a sha-256 digest")
    for key, rule in (("run", run_problem), ("save_dir", save_dir_problem)):
        problem = rule(data.get(key))
        if problem:
            raise CheckpointFormatError(f"{where}: {key} {problem}")
    files = data.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise CheckpointFormatError(f"{where}: files is not a list of 1 to {MAX_FILES} entries")
    seen = set()
    out = []
    for entry in files:
        if (not isinstance(entry, list) or len(entry) != 3 or not _name_ok(entry[0])
                or any(isinstance(v, bool) or not isinstance(v, int) for v in entry[1:])
                or not 0 <= entry[1] < 2 ** 63 or not 0 <= entry[2] < 2 ** 32):
            raise CheckpointFormatError(f"{where}: a files entry is not [a name inside the folder, a size, a CRC-32]")
        if entry[0] in seen:
            raise CheckpointFormatError(f"{where}: {quoted(entry[0])} is listed twice")
        seen.add(entry[0])
        out.append((entry[0], entry[1], entry[2]))
    return NodeManifest(data["save"], data["job"], data["tag"], step, node, nodes, world, (ranks[0], ranks[1]),
                        model, tuple(out), data["run"], data["save_dir"])


def tag_folder_problem(path: str) -> str:
    """Why the folder ``path`` is not a tag folder of ours (checked as the memory root is: no link, this
    user's, writable by nobody else), or ''."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a folder"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _whole(tag_folder: str) -> Optional[Tuple[NodeManifest, List[TagFile]]]:
    if tag_folder_problem(tag_folder):
        return None
    try:
        body, _ = read_json_object(tag_folder, NAME, "pyckpt node manifest", MAX_BYTES)
        manifest = parse(body, os.path.join(tag_folder, NAME))
        if manifest.tag != os.path.basename(os.path.normpath(tag_folder)):
            return None
        files = named_files(tag_folder, [name for name, _, _ in manifest.files])
    except (OSError, CheckpointFormatError, ValueError):
        return None
    if any(f.stat.st_size != size for f, (_, size, _) in zip(files, manifest.files)):
        return None
    return manifest, files


def read(tag_folder: str) -> Optional[NodeManifest]:
    """The manifest of the node share in ``tag_folder`` when it is whole: the folder ours (no link, this
    user's, writable by nobody else), the manifest readable, its tag the folder's name, and every file
    it lists a regular file of that size inside the folder (no link followed on the way,
    :func:`.folder_walk.named_files`). None otherwise: a half-written, foreign or damaged folder does
    not count. The files' bytes are not read here: their CRC-32 is checked where they are read
    (:func:`crcs`, by recovery)."""
    whole = _whole(tag_folder)
    return whole[0] if whole else None


def share_files(tag_folder: str) -> List[TagFile]:
    """The files of the whole node share in ``tag_folder``, by its manifest (which is not among them),
    in the manifest's order; a share that is not whole (:func:`read`) is a CheckpointFormatError."""
    whole = _whole(tag_folder)
    if whole is None:
        raise CheckpointFormatError(f"{tag_folder}: not a whole node share (its {NAME} unreadable or not its own, "
                                    f"or a file it lists missing, of another size or behind a link)")
    return whole[1]


def shares(folder: str) -> List[Tuple[str, NodeManifest]]:
    """(tag folder, manifest) of every whole node share directly in ``folder`` (a node's memory folder
    or a replica folder); hidden names (staging) and the tier's own folders are skipped."""
    out = []
    for path in _real_folders(folder, lambda name: not name.startswith(".") and not tag_reserved(name)):
        manifest = read(path)
        if manifest is not None:
            out.append((path, manifest))
    return out


def replica_folders(node_folder: str) -> List[str]:
    """The ``replica-of-node<N>`` folders in a node's memory folder (real folders only)."""
    return sorted(_real_folders(node_folder, is_replica_folder))


def _real_folders(folder: str, named) -> List[str]:
    """The paths of the real folders (no link followed) directly in ``folder`` whose names ``named``
    takes; none where ``folder`` cannot be listed."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    out = []
    for entry in entries:
        if not named(entry.name):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                out.append(entry.path)
        except OSError:
            continue
    return out


def prune(folder: str, keep: int, owner, model: str, protect: Sequence[str] = (), found=None,
          remove=None) -> List[str]:
    """Removes the shares of this job's run and this model in ``folder`` beyond the ``keep`` newest by
    step (``owner(manifest)``: whether a share is the run's; a share of another job, run or model, or a
    folder that is no share, stays), never one named in ``protect`` nor the one ``folder/latest``
    names. Returns the tag folders removed. ``found``: the folder's shares of this run and model, where
    the caller has read them already. ``remove(path)`` takes a share out (default: removed)."""
    from ...execution.leftovers import remove_path

    remove = remove or remove_path

    if found is None:
        found = [(path, m) for path, m in shares(folder) if owner(m) and m.model == model]
    mine = [(m.step, path) for path, m in found]
    latest = None
    try:  # a link or a FIFO in latest's place names nothing (and must not block)
        fd = os.open(os.path.join(folder, "latest"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                latest = os.read(fd, 4096).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
    except OSError:
        pass
    keep_names = set(protect) | ({latest} if latest else set())
    removed = []
    for _, path in sorted(mine, reverse=True)[keep:]:
        if os.path.basename(path) in keep_names:
            continue
        remove(path)
        removed.append(path)
    return removed

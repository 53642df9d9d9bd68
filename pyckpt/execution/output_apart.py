"""An output may not be, lie inside, or contain anything the checkpoint it is made from consists of.

With ``--overwrite`` any such output would replace input with output, so it is refused whatever the
caller allows. Paths are compared once links and ``.``/``..`` are resolved, so another spelling of the
same place is caught too.
"""

from __future__ import annotations

import os

from ..errors import CheckpointFormatError
from .pointer import POINTERS


def _is_or_inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _spellings(path: str) -> set:
    """Where ``path`` lies once its folders are resolved, and what it resolves to itself: a link is
    replaced where it lies, while its target is what a reader of it reads."""
    head, base = os.path.split(os.path.abspath(path))
    return {os.path.join(os.path.realpath(head), base), os.path.realpath(path)}


def check_apart(given_input, tag_folder: str, output: str, input_files=()) -> None:
    """OUTPUT may not be, lie inside, or contain any file or folder the checkpoint consists of.

    With --overwrite any of these would replace input with output, so it is refused whatever
    ``overwrite`` says. What the checkpoint consists of: the folder it is read from (``tag_folder``:
    a ZeRO tag folder, a Universal folder with its ``zero/`` tree), the folder the user named
    (``given_input``: that folder, or the save folder holding ``latest``), the pointer files
    (``latest``, ``latest_universal``) beside the tag folder and in the folder named, the tag folder
    that ``latest`` names there (the save folder's current checkpoint, whichever tag was given), and
    ``input_files``, the other files the plan read (a model config, a tokenizer beside the
    checkpoint). Links and ``.``/``..`` are resolved first, so another spelling of the same path is
    caught too. OUTPUT inside the folder holding ``latest`` is DeepSpeed's usual layout (a
    ``global_stepN_universal`` beside ``global_stepN``) and allowed, as long as it is none of these."""
    out = os.path.realpath(output)

    def refuse(relation: str, what: str) -> None:
        raise CheckpointFormatError(f"{output}: the output {relation} {what}; writing there could replace the "
                                    "checkpoint being read. Choose an output outside it (e.g. beside the tag "
                                    "folder)")

    given = os.path.realpath(os.fspath(given_input))
    for src, may_hold_output in ((os.path.realpath(tag_folder), False), (given, True)):
        inside = _is_or_inside(out, src)
        contains = src.startswith(out.rstrip(os.sep) + os.sep)
        if out == src or contains or (inside and not may_hold_output):
            refuse("is" if out == src else ("contains" if contains else "lies inside"),
                   f"the input checkpoint folder {src}")
    folders = {os.path.dirname(os.path.abspath(tag_folder)), os.path.dirname(os.path.realpath(tag_folder))}
    if os.path.isdir(given):
        folders.add(given)
    parts = [os.path.join(f, name) for f in sorted(folders) for name in POINTERS]
    parts += [os.path.join(f, tag) for f in sorted(folders) if (tag := _latest_tag(f))]
    parts += [os.fspath(f) for f in input_files]
    for path in parts:
        if not os.path.lexists(path):
            continue
        for spelling in sorted(_spellings(path)):
            inside = _is_or_inside(out, spelling)
            if inside or spelling.startswith(out.rstrip(os.sep) + os.sep):
                kind = "folder" if os.path.isdir(path) else "file"
                refuse("is" if out == spelling else ("lies inside" if inside else "contains"),
                       f"the input checkpoint's {kind} {path}")


def _latest_tag(folder: str) -> str:
    """The tag folder name ``latest`` in ``folder`` names: that checkpoint is the save folder's
    current one even when another tag folder was given; '' when there is none to read. A ``latest``
    that cannot be read is not this check's to refuse (discovery refuses it where it is the input)."""
    from ..formats.confined import read_small_text

    try:
        tag = read_small_text(folder, "latest").strip()
    except (CheckpointFormatError, OSError):
        return ""
    return tag if tag not in ("", ".", "..") and "/" not in tag and "\x00" not in tag else ""

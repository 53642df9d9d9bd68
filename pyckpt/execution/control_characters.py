"""The one rule for control characters in a name pyckpt writes or reads back (a tag, a file name of a
manifest, a save dir in a record, a pointer file's content): C0 and C1 controls and DEL are refused, so
that a one-line file holds one line and no message that names the value carries an escape sequence."""

from __future__ import annotations

import re
from typing import Optional

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def first_control(text: str) -> Optional[str]:
    """The first control character of ``text``, or None."""
    found = _CONTROL.search(text)
    return found.group() if found else None

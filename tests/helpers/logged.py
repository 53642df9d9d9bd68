"""What pyckpt says at WARNING and above, collected in a list a worker can return to its test."""

import logging
from typing import List


def pyckpt_warnings() -> List[str]:
    """A list that from now on receives the message of every record of the ``pyckpt`` logger at WARNING or above."""
    lines: List[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("pyckpt").addHandler(handler)
    return lines

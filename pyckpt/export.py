"""``python -m pyckpt.export INPUT OUTPUT``: the documented entry point of ``pyckpt export``, which lives in
:mod:`pyckpt.cli.export`; this module only forwards to its ``main``."""

import sys

# Light (os, signal, sys): a Ctrl-C from here on is one line, not a traceback from whichever import it hit.
from .cli.common import starting

if __name__ == "__main__":
    starting()

from .cli.export import main  # noqa: E402  (after the start-up handler on purpose)

if __name__ == "__main__":
    sys.exit(main())

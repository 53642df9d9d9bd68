"""``python -m pyckpt.verify OUTPUT [--against INPUT]``: the documented entry point of ``pyckpt verify``, which lives in
:mod:`pyckpt.cli.verify`; this module only forwards to its ``main``."""

import sys

# Light (os, signal, sys): a Ctrl-C from here on is one line, not a traceback from whichever import it hit.
from .cli.common import starting

if __name__ == "__main__":
    starting()

from .cli.verify import main  # noqa: E402  (after the start-up handler on purpose)

if __name__ == "__main__":
    sys.exit(main())

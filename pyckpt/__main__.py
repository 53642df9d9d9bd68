"""``python -m pyckpt COMMAND ...``: the pyckpt console script."""

import sys

if __name__ == "__main__":
    from .cli import main
    sys.exit(main(prog="python -m pyckpt"))

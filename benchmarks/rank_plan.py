"""One rank's share of a universal load's planning, without a DeepSpeed job.

    python benchmarks/rank_plan.py load   UNIVERSAL_FOLDER --world 1024 [--rank R] [--json OUT]
    python benchmarks/rank_plan.py resume ZERO_TAG_FOLDER  --world 1024 [--rank R] [--json OUT]

What a rank of pyckpt's load backend reads before its gather, at checkpoint scale: ``load`` opens
the universal folder (pyckpt.deepspeed.load.state_files.FolderStates), ``resume`` builds the view of
a ZeRO checkpoint as the universal folder it would convert to (zero_view.ZeroView: discovery and
the whole conversion plan, which every rank of a direct resume makes); then each reads the global
optimizer state and the state files of the parameters the rank holds. The rank's parameters are
those a ZeRO-1/2 partition of the dense parameters (in the model-state file's order, cut in
`world` equal parts) gives rank R, plus every AutoEP expert parameter (each EP rank holds rows of
every one). What this leaves out is DeepSpeed's side: the engine, its fragment mappings and the
gather into tensors (benchmarks/load.py measures whole loads at runnable sizes).

Prints (and with --json writes) the seconds of each step and the parameters planned.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

EXPERT = re.compile(r"\.experts\.w[123]$")


def rank_params(shapes, world: int, rank: int):
    """The parameters rank `rank` of `world` holds: its slice of the dense ones, all expert ones."""
    from pyckpt.tensors import numel

    dense = [(n, numel(s)) for n, s in shapes.items() if not EXPERT.search(n)]
    total = sum(n for _, n in dense)
    part = -(-total // world)
    lo, hi = rank * part, (rank + 1) * part
    mine, at = [], 0
    for name, n in dense:
        if at < hi and at + n > lo:
            mine.append(name)
        at += n
    return mine + [n for n in shapes if EXPERT.search(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("load", "resume"))
    p.add_argument("folder", help="universal folder (load) or ZeRO tag folder (resume)")
    p.add_argument("--world", type=int, required=True, help="ranks of the job being planned for")
    p.add_argument("--rank", type=int, help="the rank (default: the middle one)")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--json", help="write the timings here")
    args = p.parse_args(argv)
    rank = args.world // 2 if args.rank is None else args.rank
    t0 = time.perf_counter()
    import torch  # noqa: F401  (a loading job has it; the step tensors are made with it)

    from pyckpt.zero.model_states import read_model_states
    from pyckpt.formats.torch_zip import SourceFile
    from pyckpt.deepspeed.load.state_files import FolderStates
    from pyckpt.deepspeed.load.zero_view import ZeroView

    t1 = time.perf_counter()
    states = ZeroView(args.folder) if args.mode == "resume" else FolderStates(args.folder)
    t2 = time.perf_counter()
    models = sorted(n for n in os.listdir(args.folder)
                    if n.endswith("_model_states.pt") and not n.startswith("layer_"))
    shapes = read_model_states(SourceFile(os.path.join(args.folder, models[0]))).shapes
    names = rank_params(shapes, args.world, rank)
    states.global_state(args.stage)
    for name in names:
        states.param_states(name, args.stage)
    t3 = time.perf_counter()
    out = {"mode": args.mode, "world": args.world, "rank": rank, "params": len(names), "import_s": t1 - t0,
           "open_s": t2 - t1, "states_s": t3 - t2, "plan_s": t3 - t1}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

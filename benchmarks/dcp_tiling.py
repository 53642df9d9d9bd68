"""Reading a DCP folder whose tensor is cut into many small chunks, in any dimension order: the check that
the chunks tile the tensor must cost O(n log n) in chunks whichever dimension is cut.

    python benchmarks/dcp_tiling.py --chunks 100000 --rounds 3 --json benchmarks/results/dcp_tiling_100k.json

For each layout a DCP folder is crafted (torch's own metadata classes, pickled as ``dcp.save`` pickles
them; one data file holding a real ``torch.save`` archive per chunk, back to back as torch's
FileSystemWriter writes them) holding one float32 tensor cut into ``--chunks`` chunks of one element:

* ``dim0``: ``[n, 1]`` cut along dimension 0 (FSDP2's rows, the layout the old sweep was fast on);
* ``dim1``: ``[1, n]`` cut along dimension 1 (tensor parallelism's columns; the old sweep compared every
  pair of chunks);
* ``dim2``: ``[1, 1, n]`` cut along the last of three dimensions;
* ``grid``: ``[r, c]`` with ``r * c`` about ``n``, cut along both (FSDP2 x tensor parallelism);

the chunks listed in a shuffled order. Timed per layout, in rotating order per round:

* ``read``: ``pyckpt.dcp.read.read_dcp`` in this process: the metadata parsed by the allowlist unpickler,
  every entry, chunk and record checked, the tiling among them (no archive read);
* ``tiling``: ``read.check_tiling`` alone on the parsed tensor;
* ``inspect``: ``pyckpt inspect DIR --json`` as a new process: the above, and every chunk's archive read
  and checked against its chunk (what a user waits for), Python start-up included.

``--skip-inspect`` leaves the last out. Medians over the rounds; the folders are made once, before them. Each round records the 1-minute load
average as it starts: another job's processes on the machine show there.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

LAYOUTS = ("dim0", "dim1", "dim2", "grid")


def layout(name: str, n: int):
    """(shape, [offsets]) of ``n`` one-element chunks (about n for the grid)."""
    if name == "dim0":
        return (n, 1), [(i, 0) for i in range(n)]
    if name == "dim1":
        return (1, n), [(0, i) for i in range(n)]
    if name == "dim2":
        return (1, 1, n), [(0, 0, i) for i in range(n)]
    rows = int(math.isqrt(n))
    cols = -(-n // rows)
    return (rows, cols), [(i, j) for i in range(rows) for j in range(cols)]


def make_folder(folder: str, name: str, n: int, seed: int = 0) -> dict:
    """A DCP folder of one tensor ``model.w`` in the layout ``name``; what it holds."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    shape, offsets = layout(name, n)
    random.Random(seed).shuffle(offsets)
    one = (1, ) * len(shape)
    buf = io.BytesIO()
    torch.save(torch.zeros(one), buf)
    archive = buf.getvalue()
    os.makedirs(folder)
    data = "__0_0.distcp"
    with open(os.path.join(folder, data), "wb") as f:
        for _ in range(len(offsets)):
            f.write(archive)
    size = torch.Size(one)
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=size) for o in offsets]
    storage = {MetadataIndex("model.w", torch.Size(o), i): _StorageInfo(data, i * len(archive), len(archive))
               for i, o in enumerate(offsets)}
    md = Metadata(state_dict_metadata={"model.w": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape), chunks=chunks)},
        planner_data={"model.w": ("model", "w")}, storage_data=storage)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return {"shape": list(shape), "chunks": len(offsets),
            "metadata_bytes": os.path.getsize(os.path.join(folder, ".metadata")),
            "data_bytes": os.path.getsize(os.path.join(folder, data))}


def time_read(folder: str) -> dict:
    from pyckpt.dcp.read import check_tiling, read_dcp

    t0 = time.perf_counter()
    ck = read_dcp(folder)
    t1 = time.perf_counter()
    check_tiling(folder, ck.tensors["model.w"])
    t2 = time.perf_counter()
    return {"read": t1 - t0, "tiling": t2 - t1}


def time_inspect(folder: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pyckpt", "inspect", folder, "--json"], capture_output=True,
                          text=True, cwd="/")
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pyckpt inspect {folder} failed: {proc.stderr.strip()}")
    if json.loads(proc.stdout)["tensors"] != 1:
        raise SystemExit(f"pyckpt inspect {folder}: not the one tensor made")
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=100_000)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-inspect", action="store_true")
    p.add_argument("--work", default=None, help="where the folders are made (default: a temporary folder)")
    p.add_argument("--json", default=None)
    p.add_argument("--note", default="", help="recorded in the JSON (which pyckpt was measured, for instance)")
    args = p.parse_args()
    import pyckpt

    names = args.layouts.split(",")
    work = tempfile.mkdtemp(prefix="pyckpt-tiling-", dir=args.work)
    try:
        made = {}
        for name in names:
            t0 = time.perf_counter()
            made[name] = make_folder(os.path.join(work, name), name, args.chunks)
            made[name]["make_seconds"] = time.perf_counter() - t0
            print(f"made {name}: {made[name]}", file=sys.stderr)
        rounds = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            row = {"round": r, "order": order, "load_average": os.getloadavg()[0]}
            for name in order:
                folder = os.path.join(work, name)
                row[name] = time_read(folder)
                if not args.skip_inspect:
                    row[name]["inspect"] = time_inspect(folder)
                print(f"round {r} {name}: {row[name]}", file=sys.stderr)
            rounds.append(row)
        medians = {name: {k: statistics.median(row[name][k] for row in rounds) for k in rounds[0][name]}
                   for name in names}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"note": args.note, "chunks": args.chunks, "layouts": made, "rounds": rounds, "medians": medians,
              "pyckpt": os.path.dirname(pyckpt.__file__), "python": platform.python_version(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    print(json.dumps(medians, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmarks of pyckpt's native pieces (pytest-benchmark), each checking what it produced.

    pytest benchmarks/bench_native.py --benchmark-only [--benchmark-json results/native.json]
    PYCKPT_BENCH_MIB=64 pytest benchmarks/bench_native.py --benchmark-only    # a quick pass

Not part of the test run (testpaths is tests/). The payload of the per-GB benchmarks is
PYCKPT_BENCH_MIB of output (default 1024); extra_info carries GB/s so the JSON speaks per GB.
  * archive open: the ZIP member table of a shard with many members (_core.Archive), and the
    same plus the safe unpickler (SourceFile.load), which is what pyckpt pays per input shard;
  * plan execution: pyckpt.execution.executor.execute gathering a tensor from shuffled fragments of a source shard, as
    a ZeRO merge does, once as a plain copy and once converting bf16 to fp32 on the way;
  * writer: one archive of many small records, where per-record overhead (headers, CRC, central
    directory) dominates instead of bandwidth.
"""

from __future__ import annotations

import os
import random
import shutil
import zipfile
import zlib

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from pyckpt import _core  # noqa: E402
from pyckpt.formats.torch_zip import SourceFile  # noqa: E402
from pyckpt.execution.executor import execute  # noqa: E402
from pyckpt.native import CONVERT_TO_F32  # noqa: E402
from pyckpt.planning.plan import Piece, Plan  # noqa: E402
from pyckpt.tensors import NewTensor  # noqa: E402

MIB = int(os.environ.get("PYCKPT_BENCH_MIB", "1024"))
MANY = 5000  # members of the "many members" shard: a ZeRO-3 shard of a deep model has thousands
SMALL = 20000  # records of the writer benchmark
FRAGMENTS = 64  # fragments per gathered tensor, as from dp 64 shards
ROUNDS = 5


def _gbps(benchmark, nbytes):
    # pytest-benchmark reports seconds; bytes per second of the fastest round is what compares to cp.
    benchmark.extra_info["bytes"] = nbytes
    if benchmark.stats is None:  # --benchmark-disable: run once for the correctness checks only
        return
    benchmark.extra_info["gb_per_s_best"] = nbytes / benchmark.stats.stats.min / 1e9
    benchmark.extra_info["gb_per_s_median"] = nbytes / benchmark.stats.stats.median / 1e9


@pytest.fixture(scope="module")
def many_member_shard(tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.w": torch.rand(1 + i % 97, generator=gen) for i in range(MANY)}
    path = tmp_path_factory.mktemp("shard") / "many.pt"
    torch.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    # Output elements: MIB MiB of fp32. The fp32 source is that size, the bf16 source half.
    numel = MIB * 2**20 // 4
    gen = torch.Generator().manual_seed(1)
    fp32 = torch.rand(numel, generator=gen) * 2 - 1
    d = tmp_path_factory.mktemp("big")
    torch.save({"flat": fp32}, d / "fp32.pt")
    torch.save({"flat": fp32.bfloat16()}, d / "bf16.pt")
    del fp32
    return d / "fp32.pt", d / "bf16.pt", numel


def _fragments(numel, seed):
    # Uneven cut points in a shuffled order: each output fragment lands at a different offset than
    # its source's, so a gather that mixes up offsets shows in the check.
    rnd = random.Random(seed)
    cuts = sorted(rnd.sample(range(1, numel), FRAGMENTS - 1))
    spans = list(zip([0] + cuts, cuts + [numel]))
    order = list(range(len(spans)))
    rnd.shuffle(order)
    return [spans[i] for i in order]


def _gather_plan(src_path, numel, kind):
    sf = SourceFile(str(src_path))
    flat = sf.load()["flat"]
    base, _ = sf.tensor_byte_range(flat)
    in_size = flat.itemsize
    pieces, dst = [], 0
    spans = _fragments(numel, seed=2)
    for lo, hi in spans:
        pieces.append(Piece(sf, base + lo * in_size, (hi - lo) * in_size, dst, kind))
        dst += (hi - lo) * 4
    plan = Plan()
    plan.add_archive("out/fp32.pt", {"param": NewTensor("float32", (numel, ), pieces)})
    return plan, spans


def _expected(src_tensor, spans):
    return torch.cat([src_tensor[lo:hi] for lo, hi in spans]).float()


def _execute_rounds(benchmark, plan, root):
    def setup():
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)

    return benchmark.pedantic(execute, args=(plan, str(root)), setup=setup, rounds=ROUNDS, iterations=1)


# -- archive open ------------------------------------------------------------------------------

def test_archive_open_many_members(benchmark, many_member_shard):
    path, state = many_member_shard

    def open_members():
        with _core.Archive(str(path)) as ar:
            return ar.prefix, list(ar.members()), ar.read(ar.prefix + "/data/17")

    prefix, members, rec17 = benchmark(open_members)
    # torch.save writes data.pkl, byteorder, .format_version, .storage_alignment, version and one
    # record per storage; the CRCs must be the ZIP's own, the bytes the tensor's.
    assert sum(1 for m in members if m[0].startswith(prefix + "/data/")) == MANY
    with zipfile.ZipFile(path) as zf:
        crcs = {i.filename: i.CRC for i in zf.infolist()}
    assert {name: crc for name, _, _, crc in members} == crcs
    assert zlib.crc32(rec17) == crcs[prefix + "/data/17"]
    benchmark.extra_info["members"] = len(members)


def test_source_file_open_and_unpickle(benchmark, many_member_shard):
    path, state = many_member_shard

    def open_and_load():
        sf = SourceFile(str(path))
        return sf, sf.load()

    sf, obj = benchmark(open_and_load)
    assert list(obj) == list(state)
    for name in ("layer.0.w", "layer.1234.w", f"layer.{MANY - 1}.w"):
        t = obj[name]
        off, n = sf.tensor_byte_range(t)
        assert sf.read_bytes(off, n) == state[name].numpy().tobytes()


# -- plan execution per GB ---------------------------------------------------------------------

def test_plan_copy_per_gb(benchmark, big_source, tmp_path):
    fp32_path, _, numel = big_source
    plan, spans = _gather_plan(fp32_path, numel, 0)
    result = _execute_rounds(benchmark, plan, tmp_path / "o")
    assert result["tensor_bytes"] == numel * 4
    _gbps(benchmark, numel * 4)
    got = torch.load(tmp_path / "o" / "out" / "fp32.pt", mmap=True, weights_only=True)["param"]
    src = torch.load(fp32_path, mmap=True, weights_only=True)["flat"]
    assert torch.equal(got, _expected(src, spans))


def test_plan_bf16_to_fp32_per_gb(benchmark, big_source, tmp_path):
    _, bf16_path, numel = big_source
    plan, spans = _gather_plan(bf16_path, numel, CONVERT_TO_F32["bfloat16"])
    result = _execute_rounds(benchmark, plan, tmp_path / "o")
    assert result["tensor_bytes"] == numel * 4
    _gbps(benchmark, numel * 4)
    got = torch.load(tmp_path / "o" / "out" / "fp32.pt", mmap=True, weights_only=True)["param"]
    src = torch.load(bf16_path, mmap=True, weights_only=True)["flat"]
    # Tensor.float() of the gathered bf16: the same widening the executor must do, bit for bit.
    assert torch.equal(got, _expected(src, spans))


# -- writer: many small records ----------------------------------------------------------------

def test_writer_many_small_records(benchmark, many_member_shard, tmp_path):
    path, state = many_member_shard
    sf = SourceFile(str(path))
    obj = sf.load()
    names = list(obj)[:SMALL]
    out = {}
    for i in range(SMALL):
        t = obj[names[i % len(names)]]
        off, n = sf.tensor_byte_range(t)
        out[f"r{i}"] = NewTensor("float32", tuple(t.shape), [Piece(sf, off, n, 0)])
    plan = Plan()
    plan.add_archive("small.pt", out)
    result = _execute_rounds(benchmark, plan, tmp_path / "o")
    benchmark.extra_info["records"] = SMALL
    benchmark.extra_info["bytes"] = result["tensor_bytes"]
    target = tmp_path / "o" / "small.pt"
    with zipfile.ZipFile(target) as zf:
        assert zf.testzip() is None  # every member's CRC recomputed by Python's zipfile
        assert sum(1 for n in zf.namelist() if "/data/" in n) == SMALL
    got = torch.load(target, weights_only=True)
    for i in (0, 1, 4999, 5000, SMALL - 1):
        assert torch.equal(got[f"r{i}"], state[names[i % len(names)]])

"""A conversion spread over the processes of a torch.distributed job (pyckpt.execution.distributed).

Fast tests deal plans out (every output once, balanced), run the spread protocol on threads that
stand in for ranks (the same output as one process; a failure on one rank raises on all, naming
it, and leaves nothing), and count with mincore that each rank's share brings only its own source
bytes into the page cache. Slow tests launch `torchrun -m pyckpt.convert` and `-m pyckpt.export` at
2 and 4 processes on real ZeRO-2 and ZeRO-3 checkpoints and compare the output folder byte for byte
with a single process's, and start the ranks of a failing launch by hand to see each one's exit.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagecache import evict, resident_bytes
from rendezvous import held_rendezvous
from pyckpt.errors import OutputExistsError, RanksFailedError
from pyckpt.execution.distributed import plan_digest, split_outputs
from pyckpt.execution.executor import compile_plan, execute
from pyckpt.huggingface.export import export_hf
from pyckpt.planning.plan import Plan
from pyckpt.universal.convert import convert_to_universal

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "benchmarks" / "make_checkpoint.py"
TIMEOUT_S = 240


def _files(folder: Path) -> dict:
    """relative path -> bytes of every file under ``folder`` (the folder's whole content)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _generated(tmp_path: Path, stage: int, params: str = "2M", dp: int = 4) -> Path:
    ckpt = tmp_path / f"gen_z{stage}"
    subprocess.run([sys.executable, str(GENERATOR), str(ckpt), "--params", params, "--dp", str(dp), "--stage",
                    str(stage)], check=True, capture_output=True, timeout=TIMEOUT_S)
    return ckpt


def _plan_of(ckpt: Path) -> Plan:
    from pyckpt.zero.discovery import discover
    from pyckpt.universal.write import build_plan

    return build_plan(discover(ckpt), False, False, True)[0]


# -- dealing a plan out --------------------------------------------------------------------------

def _sized_plan(sizes) -> Plan:
    plan = Plan()
    for i, n in enumerate(sizes):
        plan.add_raw_file(f"f{i:03d}", b"x" * n)
    return plan


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 64])
def test_split_gives_every_output_to_one_rank_balanced_by_bytes(seed, size):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 10, 100, 1000, 5000]) * rng.randint(1, 9) for _ in range(rng.randint(0, 40))]
    plan = _sized_plan(sizes)
    shares = split_outputs(plan, size)
    assert len(shares) == size
    dealt = sorted(r.relpath for share in shares for r in share.raw_files)
    assert dealt == sorted(r.relpath for r in plan.raw_files)  # each once, none lost
    loads = [sum(len(r.head) for r in share.raw_files) for share in shares]
    assert sum(loads) == sum(sizes)
    if sizes:
        assert max(loads) <= sum(sizes) / size + max(sizes)
    # every rank computes the same deal, and a share keeps the plan's order
    again = split_outputs(_sized_plan(sizes), size)
    assert [[r.relpath for r in s.raw_files] for s in again] == [[r.relpath for r in s.raw_files] for s in shares]
    for share in shares:
        names = [r.relpath for r in share.raw_files]
        assert names == sorted(names)


def test_split_of_a_real_plan_deals_archives_raw_files_and_copies(tmp_path):
    plan = _plan_of(_generated(tmp_path, 2, "200k"))
    assert plan.archives and plan.copies
    shares = split_outputs(plan, 3)
    for attr in ("archives", "raw_files", "copies"):
        dealt = sorted(o.relpath for s in shares for o in getattr(s, attr))
        assert dealt == sorted(o.relpath for o in getattr(plan, attr)), attr
    assert sum(plan_digest(s)[1] for s in shares) == plan_digest(plan)[1]
    with pytest.raises(ValueError):
        split_outputs(plan, 0)


def test_digest_tells_plans_apart():
    assert plan_digest(_sized_plan([1, 2])) == plan_digest(_sized_plan([1, 2]))
    assert plan_digest(_sized_plan([1, 2])) != plan_digest(_sized_plan([1, 3]))
    assert plan_digest(_sized_plan([1, 2]))[:2] == (2, 3)


# -- the protocol, on threads standing in for ranks -----------------------------------------------

class _Board:
    def __init__(self, size):
        self.size = size
        self.slots = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


class ThreadRanks:
    """TorchRanks' interface over threads of one process: the collectives are barriers."""

    def __init__(self, rank, board):
        self.rank, self.size, self._board = rank, board.size, board

    def all_gather(self, obj):
        self._board.slots[self.rank] = obj
        self._board.barrier.wait()
        out = list(self._board.slots)
        self._board.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return out

    def broadcast(self, obj, src=0):
        return self.all_gather(obj)[src]


def _run_ranks(size, fn):
    """fn(ranks) on ``size`` threads; (results, exceptions) by rank."""
    board = _Board(size)
    results, errors = [None] * size, [None] * size

    def body(rank):
        try:
            results[rank] = fn(ThreadRanks(rank, board))
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank was left waiting"
    return results, errors


def _leftovers(parent: Path, name: str):
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{name}."))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_threads_as_ranks_write_what_one_process_writes(tmp_path, stage, size):
    ckpt = _generated(tmp_path, stage, "200k")
    single = convert_to_universal(ckpt, tmp_path / "one" / "u")
    reports, errors = _run_ranks(size, lambda r: convert_to_universal(ckpt, tmp_path / "many" / "u", ranks=r))
    assert errors == [None] * size
    assert _files(tmp_path / "many") == _files(tmp_path / "one")  # latest_universal included
    for report in reports:  # every rank reports the totals of all
        assert (report.bytes_written, report.files, report.tensor_bytes) == \
            (single.bytes_written, single.files, single.tensor_bytes)
    assert _leftovers(tmp_path / "many", "u") == []


def test_a_failing_rank_fails_every_rank_and_leaves_nothing(tmp_path, monkeypatch):
    ckpt = _generated(tmp_path, 2, "200k")
    monkeypatch.setenv("PYCKPT_TEST_FAIL_RANK", "1")
    _, errors = _run_ranks(3, lambda r: convert_to_universal(ckpt, tmp_path / "out" / "u", ranks=r))
    for exc in errors:
        assert isinstance(exc, RanksFailedError), errors
        assert exc.failures.keys() == {1} and "injected failure on rank 1" in str(exc), str(exc)
        assert "writing the output files failed on 1 of 3 ranks; rank 1: OSError" in str(exc)
    assert isinstance(errors[1].__cause__, OSError)  # the failed rank keeps its own error as the cause
    assert os.listdir(tmp_path / "out") == []  # no output, pointer, staging or lock file


def test_rank_0_refusing_the_output_fails_every_rank(tmp_path):
    ckpt = _generated(tmp_path, 2, "200k")
    (tmp_path / "out" / "u").mkdir(parents=True)
    _, errors = _run_ranks(2, lambda r: convert_to_universal(ckpt, tmp_path / "out" / "u", ranks=r))
    assert all(isinstance(e, RanksFailedError) and e.failures.keys() == {0} and "already exists" in str(e)
               for e in errors), errors
    assert isinstance(errors[0].__cause__, OutputExistsError)
    assert os.listdir(tmp_path / "out" / "u") == [] and _leftovers(tmp_path / "out", "u") == []


@pytest.mark.parametrize("write", [convert_to_universal, export_hf])
def test_every_rank_refuses_an_output_that_is_part_of_the_input(tmp_path, write):
    """Spread over ranks, an OUTPUT that is the input's `latest` is refused on every rank before any
    writes, --overwrite or not, and `latest` stays the file it was (issue 36, item 3)."""
    import pyckpt.testing as mc
    from compare import digest

    root = mc.make_checkpoint(tmp_path / "ck", params=20000, dp=2, stage=2).parent
    before = digest(root)
    _, errors = _run_ranks(2, lambda r: write(root, root / "latest", overwrite=True, ranks=r))
    for exc in errors:
        assert isinstance(exc, RanksFailedError) and exc.failures.keys() == {0, 1}, errors
        assert f"the output is the input checkpoint's file {root / 'latest'}" in str(exc), str(exc)
    assert digest(root) == before and sorted(os.listdir(tmp_path)) == ["ck"]


def test_ranks_that_plan_differently_are_refused(tmp_path):
    """Nodes that see different inputs (another checkpoint, another pyckpt) must not write one output."""
    a, b = _generated(tmp_path / "a", 2, "200k"), _generated(tmp_path / "b", 2, "300k")
    _, errors = _run_ranks(2, lambda r: convert_to_universal(a if r.rank == 0 else b, tmp_path / "out" / "u", ranks=r))
    for exc in errors:
        assert isinstance(exc, RanksFailedError) and exc.failures.keys() == {1}, errors
        assert "planning the conversion" in str(exc) and "the ranks disagree" in str(exc)
    assert not (tmp_path / "out").exists()


def test_a_planning_failure_on_one_rank_reaches_the_others(tmp_path):
    ckpt = _generated(tmp_path, 2, "200k")
    _, errors = _run_ranks(2, lambda r: convert_to_universal(ckpt if r.rank == 0 else tmp_path / "missing",
                                                             tmp_path / "out" / "u", ranks=r))
    assert all(isinstance(e, RanksFailedError) and e.failures.keys() == {1} for e in errors), errors
    assert "missing" in str(errors[0])


def test_sharded_export_on_threads_equals_one_process(tmp_path):
    ckpt = _generated(tmp_path, 3, "200k")
    export_hf(ckpt, tmp_path / "one", max_shard_size="50KB")
    _, errors = _run_ranks(3, lambda r: export_hf(ckpt, tmp_path / "many", max_shard_size="50KB", ranks=r))
    assert errors == [None] * 3
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    assert len([n for n in os.listdir(tmp_path / "one") if n.endswith(".safetensors")]) >= 3


def test_one_rank_or_none_is_todays_single_process_run(tmp_path):
    ckpt = _generated(tmp_path, 2, "200k")
    convert_to_universal(ckpt, tmp_path / "a" / "u")
    _run_ranks(1, lambda r: convert_to_universal(ckpt, tmp_path / "b" / "u", ranks=r))
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


# -- each rank reads its own bytes ---------------------------------------------------------------

def _source_pages(share: Plan, root: str) -> dict:
    """source path -> the pages of it that ``share``'s ops read (whole files for copies)."""
    page = os.sysconf("SC_PAGE_SIZE")
    sources, _, ops, _ = compile_plan(share, root)
    pages = {path: set() for path in sources}
    for row in (ops.tolist() if len(ops) else []):
        src, off, nbytes, kind, rows = row[0], row[1], row[5], row[6], row[7]
        assert kind == 0 and rows == 1, row  # a plain copy: the bytes read are the bytes written
        pages[sources[src]].update(range(off // page, (off + nbytes + page - 1) // page))
    for c in share.copies:
        pages.setdefault(c.src.path, set()).update(range((c.src.size + page - 1) // page))
    return pages


@pytest.mark.parametrize("stage", [2, 3])
def test_each_share_brings_only_its_own_bytes_into_the_page_cache(tmp_path, stage):
    page = os.sysconf("SC_PAGE_SIZE")
    ckpt = _generated(tmp_path, stage, "4M")
    plan = _plan_of(ckpt)
    files = sorted(str(p) for p in (ckpt / "global_step1").iterdir())
    size = 3
    shares = split_outputs(plan, size)
    total = sum(os.path.getsize(f) for f in files)
    for rank, share in enumerate(shares):
        expected = _source_pages(share, str(tmp_path / f"rank{rank}"))
        own = sum(len(p) for p in expected.values()) * page
        (tmp_path / f"rank{rank}").mkdir()
        for f in files:
            evict(f)
        before = sum(resident_bytes(f) for f in files)
        assert before < total // 50, "the page cache kept the files: the count would mean nothing"
        execute(share, str(tmp_path / f"rank{rank}"), workers=2)
        grown = sum(resident_bytes(f) for f in files) - before
        # the share, give or take the pages around each file's records that the executor checks
        assert own * 0.95 <= grown <= own * 1.05 + 4 * page * len(expected), (rank, own, grown, total)
        assert grown < total * 0.6, (rank, grown, total)  # not the whole checkpoint


# -- real launches (slow) ------------------------------------------------------------------------

def _env(ds_environ) -> dict:
    env = {**ds_environ, "PYTHONDONTWRITEBYTECODE": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return env


def _torchrun(nproc: int, module: str, *args, env: dict, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", module,
           *map(str, args)]
    # cwd outside the source folder: `-m pyckpt...` must import the installed package (the source
    # folder has no native module unless installed in place, as on CI)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=cwd)


LAUNCHES = [("s2_fp32_dp4", 2), ("s3_fp32_dp4", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s2_fp32_dp4", "s3_fp32_dp4"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_convert_equals_one_process(checkpoints, ds_environ, tmp_path, name, nproc):
    ck = checkpoints[name]
    convert_to_universal(ck.root, tmp_path / "one" / "u")
    proc = _torchrun(nproc, "pyckpt.convert", ck.root, tmp_path / "many" / "u", "--json", env=_env(ds_environ), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    assert (tmp_path / "many" / "latest_universal").read_text() == "u"
    assert proc.stdout.count('"bytes_written"') == 1  # rank 0 alone reports
    assert proc.stderr.count("pyckpt: converted") == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s2_fp32_dp4", "s3_fp32_dp4"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_sharded_export_equals_one_process(checkpoints, ds_environ, tmp_path, name, nproc):
    ck = checkpoints[name]
    export_hf(ck.root, tmp_path / "one", max_shard_size=50)
    assert len([n for n in os.listdir(tmp_path / "one") if n.endswith(".safetensors")]) >= 3
    proc = _torchrun(nproc, "pyckpt.export", ck.root, tmp_path / "many", "--max_shard_size", "50",
                     env=_env(ds_environ), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    assert proc.stderr.count("pyckpt: exported") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_two_node_launch_equals_one_process(checkpoints, ds_environ, tmp_path):
    """Two torchrun agents, as on two nodes sharing a filesystem (here both on this machine): global
    ranks differ from local ones, and only global rank 0 (on whichever agent the rendezvous made node 0)
    stages, publishes and reports."""
    ck = checkpoints["s3_fp32_dp4"]
    convert_to_universal(ck.root, tmp_path / "one" / "u")
    with held_rendezvous() as rendezvous:
        agents = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", *rendezvous,
             "--rdzv-id", "two-nodes", "-m", "pyckpt.convert", str(ck.root), str(tmp_path / "many" / "u"), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(ds_environ), cwd=tmp_path)
            for _ in (0, 1)]
        outs = [a.communicate(timeout=TIMEOUT_S) for a in agents]
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    assert (tmp_path / "many" / "latest_universal").read_text() == "u"
    reports = sorted((out.count('"bytes_written"'), err.count("pyckpt: converted")) for out, err in outs)
    assert reports == [(0, 0), (1, 1)], reports


@pytest.mark.slow
def test_a_failing_rank_fails_every_process_of_a_launch(checkpoints, ds_environ, tmp_path):
    """The ranks are started here, as torchrun starts them, to see each one's exit status and output."""
    ck = checkpoints["s2_fp32_dp4"]
    size, port = 3, _free_port()
    procs = []
    for rank in range(size):
        env = {**_env(ds_environ), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
               "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYCKPT_TEST_FAIL_RANK": "2"}
        procs.append(subprocess.Popen([sys.executable, "-m", "pyckpt.convert", str(ck.root), str(tmp_path / "out" / "u")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=tmp_path))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1] * size, outs
    assert "failed on 1 of 3 ranks; rank 2: OSError" in outs[0][1] and "injected failure on rank 2" in outs[0][1]
    assert all("pyckpt: error" not in err for _, err in outs[1:]), outs  # said once, by rank 0
    assert os.listdir(tmp_path / "out") == []

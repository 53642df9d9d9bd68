"""The accelerated universal load (`pyckpt.deepspeed.enable()`) against DeepSpeed 0.19.8's own loader.

Real DeepSpeed on CPU: checkpoints saved by training runs, converted by DeepSpeed's
`ds_to_universal.py`, then loaded at other world sizes twice in the same ranks, by DeepSpeed's
loader and through pyckpt (tests/workers/load_backend_worker.py). Every rank's restored state is compared
field by field (flat fp32 partitions with their padding, every optimizer state tensor, step,
hyper-parameters, loss-scaler fields, low-precision parameters, fragment views, counters, scheduler,
client state), then again after one more training step, and each rank must have read exactly its
own share of the state files. Where pyckpt corrects DeepSpeed (ZeRO-3: the step shared across
sub-groups, group 0's hyper-parameters for every group), the reference is DeepSpeed's load with
those two fields put right (load_backend_worker.correct_zero3_load) and, at the saved topology, a
run that never went through a checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

import dsharness as h
from dsharness import _launch

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).resolve().parents[2] / "workers" / "load_backend_worker.py")
TAG = "global_step3_universal"

# Every case trains with an LR scheduler and saves a client_state payload, so the scheduler and
# client-state comparisons compare something (without them both sides hold None and {}).
RICH = {"lr_scheduler": True, "client_payload": True}

# (saved config, target world sizes)
CASES = {
    "z1-fp32": (h.Config(1, "fp32", 2, **RICH), (3, 1)),
    # bf16 with bf16 gradient accumulation: DeepSpeedZeroOptimizer (ZeRO-1 with fp32 accumulation
    # takes BF16_Optimizer, the next case; _optimizer says which)
    "z1-bf16": (h.Config(1, "bf16", 2, **RICH), (3, 4)),
    "z2-bf16": (h.Config(2, "bf16", 2, **RICH), (3, 4)),
    "z2-fp32-frozen_tied": (h.Config(2, "fp32", 2, model="frozen_tied", **RICH), (4, 1)),
    "bf16_optimizer": (h.Config(1, "bf16", 2, grad_accum_dtype="fp32", **RICH), (3, 4)),
    "z3-fp32-subgroups": (h.Config(3, "fp32", 2, sub_group_size=16, **RICH), (3, 1)),
    "z3-bf16": (h.Config(3, "bf16", 2, **RICH), (3, 4)),
    "z3-bf16-frozen_tied": (h.Config(3, "bf16", 4, model="frozen_tied", **RICH), (2, 3)),
    # two param groups with their own hyper-parameters; saved at dp 4, the bias group (10 elements,
    # padded to 16) leaves rank 3's partition all padding (DeepSpeed's load: IndexError, see below)
    "z2-fp32-groups": (h.Config(2, "fp32", 4, groups=True, **RICH), (3, 2)),
    "z3-fp32-groups": (h.Config(3, "fp32", 2, groups=True, sub_group_size=16, **RICH), (3, 1)),
    # AutoTP tp 2 -> 1 and -> 4 (affine maps, uneven lm_head rows, fused sub-parameters, dim-1 cuts),
    # AutoEP autoep_size 2 -> 4 and -> 1: targets that change more than the world size
    # (AutoEP before AutoTP: one launch runs its tasks in this order, and AutoTP leaves process-wide
    # state behind (set_autotp_mode); a ZeRO-3 AutoEP engine built after it came out with expert
    # ds_tensors that differed between two loads of the same folder)
    "z1-fp32-autoep": (h.Config(1, "fp32", 2, model="moe", ep_size=2, **RICH),
                       ({"world_size": 4, "ep_size": 4}, {"world_size": 2, "ep_size": 1})),
    "z3-fp32-autoep": (h.Config(3, "fp32", 2, model="moe", ep_size=2, **RICH),
                       ({"world_size": 4, "ep_size": 4}, {"world_size": 2, "ep_size": 1})),
    "z2-fp32-autotp": (h.Config(2, "fp32", 4, model="llama", tp_size=2, **RICH),
                       ({"world_size": 2, "tp_size": None}, {"world_size": 4, "tp_size": 4})),
    "z3-bf16-autotp": (h.Config(3, "bf16", 4, model="llama", tp_size=2, **RICH),
                       ({"world_size": 2, "tp_size": None}, {"world_size": 4, "tp_size": 4})),
}


def _optimizer(name: str) -> str:
    """The ZeRO optimizer class DeepSpeed's engine picks for a case (engine._do_optimizer_sanity_check:
    ZeRO-1 with bf16 parameters and fp32 gradient accumulation is BF16_Optimizer's)."""
    cfg = CASES[name.removesuffix("-nouc")][0]
    if cfg.stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    return "BF16_Optimizer" if name == "bf16_optimizer" else "DeepSpeedZeroOptimizer"


def _check_restored_extras(r: dict, cfg: h.Config, where) -> None:
    """The scheduler at the saved iteration (one more after the step), and a client state that holds
    more than the payload (the comparisons of both would otherwise hold on None and {})."""
    saved = {"last_batch_iteration": cfg.steps - 1}
    assert r["scheduler"] == (saved, {"last_batch_iteration": cfg.steps}), (where, r["scheduler"])
    assert r["client_keys"] > 20, (where, "the flattened client state holds DeepSpeed's keys and the payload")


def _check_model_state_reads(info: dict, where) -> None:
    """Each model-state file the load opened was read once, memory-mapped by torch's weights-only
    reader, and no `module` tensor of it was read into memory (ModelStateReads records every
    torch.load of such a file, DeepSpeed's own included). Two files where a rank's source tp rank is
    not the first: DeepSpeed checks that one."""
    reads = info["reads"]
    paths = [r["path"] for r in reads]
    assert 1 <= len(paths) <= 2 and len(set(paths)) == len(paths), (where, reads)
    for r in reads:
        assert r["mmap"] and r["weights_only"] is True and r["materialised"] == 0, (where, r)
    assert sorted(paths) == sorted(os.path.realpath(p) for p in info["model_states_mapped"]), (where, info)
    assert info["model_states_refused"] == [], (where, info)


def _target(cfg: h.Config, target) -> h.Config:
    """A case's load configuration: the saved one at another world size (an int), or with more changed."""
    return dataclasses.replace(cfg, world_size=target) if isinstance(target, int) else dataclasses.replace(cfg, **target)


def _tid(target) -> str:
    if isinstance(target, int):
        return f"ws{target}"
    return "-".join(f"{k.split('_')[0]}{v or 1}" if k != "world_size" else f"ws{v}" for k, v in target.items())


# The ZeRO-3 step DeepSpeed shares across sub-groups: with more than one sub-group, the step after
# its load advances the shared step once per sub-group, so steps, masters and moments after that
# step would differ from pyckpt's (which match a run without checkpoint:
# test_fixed_fields_match_a_run_without_checkpoint).
SHARED_STEP_DIVERGES = {"z3-fp32-subgroups", "z3-fp32-groups"}
# DeepSpeed's ZeRO-3 load gives every group group 0's hyper-parameters; pyckpt keeps each group's own
# (the same test). For these cases the stock side of the comparison is corrected after its load
# (correct_zero3_load), and the comparison then holds bit for bit before and after the next step.
GROUP0_HYPER = {"z3-fp32-groups", "z3-fp32-autoep"}


def _call(function: str, cfg: h.Config, **extra) -> dict:
    return {"kind": "call", "module": WORKER, "function": function, "cfg": dataclasses.asdict(cfg), **extra}


# Most refusal and small-load cases cost less than their launch's start (every rank importing DeepSpeed and
# joining the process group): each such test prepares its tasks in a function registered here, the `batched`
# fixture runs every prepared task in one launch per world size (the tasks already run one after another in
# the same ranks, catching their own failures), and each test checks its own results.
BATCHED = {}


def _batched(prepare):
    """Registers ``prepare(universal, tmp) -> ([(key, world size, task), ...], context)``."""
    BATCHED[prepare.__name__] = prepare
    return prepare


@pytest.fixture(scope="module")
def batched(universal, tmp_path_factory):
    """name -> ({key: rank 0's result}, context) for every function in BATCHED."""
    by_ws, out = {}, {}
    for name, prepare in BATCHED.items():
        items, context = prepare(universal, tmp_path_factory.mktemp(name.strip("_")))
        out[name] = ({}, context)
        for key, ws, task in items:
            by_ws.setdefault(ws, []).append((name, key, task))
    for ws, items in sorted(by_ws.items()):
        for (name, key, _), res in zip(items, _launch(ws, [t for _, _, t in items], None, f"batched ws{ws}",
                                                      120 * len(items))):
            out[name][0][key] = res
    return out


# z2-bf16's run saved without universal_checkpoint_info (as --inject_missing_state does): DIRECT's "-nouc"
NOUC = dataclasses.replace(CASES["z2-bf16"][0], uc_info=False)
# Wide models for the page-cache counts (test_each_rank_brings_only_its_share_into_the_page_cache)
PAGE_CASES = {"z2-fp32-wide": h.Config(2, "fp32", 2, model="wide"), "z3-fp32-wide": h.Config(3, "fp32", 2, model="wide")}


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Every checkpoint this file reads, saved by DeepSpeed in one launch per world size (make_checkpoints) and
    converted by one run of DeepSpeed's ds_to_universal: CASES, z2-bf16-nouc (trained right after z2-bf16, whose
    converted folder its resume is compared with) and PAGE_CASES (last: nothing compares their values)."""
    base = tmp_path_factory.mktemp("load_backend")
    # Saved in a launch of its own, as the run without checkpoint it is compared with to the last bit
    # is: saved after a ZeRO-3 bf16 engine had trained in the same processes, its Adam moments
    # differed from a fresh run's in the last bit (the cause was not pinned down).
    alone = {"z2-fp32-groups"}
    batch = {}
    for name, (cfg, _) in CASES.items():
        if name not in alone:
            batch[name] = cfg
        if name == "z2-bf16":
            batch["z2-bf16-nouc"] = NOUC
    batch.update(PAGE_CASES)
    made = dict(zip(batch, h.make_checkpoints([(cfg, base / name) for name, cfg in batch.items()])))
    for name in alone:
        made[name] = h.make_checkpoints([(CASES[name][0], base / name)])[0]
    converted = [made[name] for name in (*CASES, *PAGE_CASES)]
    h.run_ds_to_universal_many([(ck.tag_dir, ck.root / TAG) for ck in converted])
    for ck in converted:
        (ck.root / "latest_universal").write_text(TAG)
    return made


@pytest.fixture(scope="session")
def universal(saved):
    """Every case's checkpoint, saved by DeepSpeed and converted by DeepSpeed's ds_to_universal."""
    return {name: saved[name] for name in CASES}


# Resuming straight from the ZeRO checkpoint: (case, target world size); "-nouc" reads the same run
# saved without universal_checkpoint_info (as --inject_missing_state does) against the case's
# converted folder.
DIRECT = [(name, target) for name in ("z1-fp32", "z1-bf16", "z2-bf16", "z2-fp32-groups", "bf16_optimizer",
                                      "z3-fp32-subgroups", "z3-bf16-frozen_tied", "z2-fp32-frozen_tied",
                                      "z1-fp32-autoep", "z3-fp32-autoep", "z2-fp32-autotp", "z3-bf16-autotp")
          for target in CASES[name][1]] + [("z2-bf16-nouc", 3)]
DIRECT_IDS = [f"{n}-{_tid(t)}" for n, t in DIRECT]


@pytest.fixture(scope="session")
def launched(saved):
    """Each case loaded at each target world size, stock and pyckpt in the same ranks ("run"), and each of
    DIRECT resumed straight from its ZeRO checkpoint ("direct"): one launch per world size for both (a launch's
    start costs more than most of its tasks), the AutoTP cases last (AutoTP leaves process-wide state behind:
    see CASES)."""
    by_ws = {}
    for name, (cfg, targets) in CASES.items():
        for target in targets:
            task = _call("run", _target(cfg, target), root=str(saved[name].root), tag=TAG,
                         correct=name in SHARED_STEP_DIVERGES | GROUP0_HYPER)
            by_ws.setdefault(_target(cfg, target).world_size, []).append((("run", name, _tid(target)), task))
    for name, target in DIRECT:
        case = name.removesuffix("-nouc")
        cfg = _target(CASES[case][0], target)
        extra = {"direct_root": str(saved[name].root)} if name.endswith("-nouc") else {}
        task = _call("direct", cfg, root=str(saved[case].root), tag=TAG, **extra)
        by_ws.setdefault(cfg.world_size, []).append((("direct", name, _tid(target)), task))
    results = {"run": {}, "direct": {}}
    for ws, items in sorted(by_ws.items()):
        items.sort(key=lambda item: item[0][1].endswith("-autotp"))  # stable: the rest keep their order
        for (way, name, target), res in zip([k for k, _ in items], _launch(ws, [t for _, t in items], None,
                                                                          f"load backend ws{ws}", 300 * 2)):
            results[way][name, target] = res["ranks"]
    return results


@pytest.fixture(scope="session")
def loads(launched):
    return launched["run"]


PAIRS = [(name, _tid(t)) for name, (_, targets) in CASES.items() for t in targets]


@pytest.mark.parametrize("name,ws", PAIRS, ids=[f"{n}-{w}" for n, w in PAIRS])
def test_state_equals_deepspeeds_own_load(loads, name, ws):
    ranks = loads[name, ws]
    assert len(ranks) == int(ws.split("-")[0][2:])
    cfg = CASES[name][0]
    for rank, r in enumerate(ranks):
        assert r["info"]["backend"] == "pyckpt", (rank, r["info"])
        assert r["info"]["optimizer"] == r["stock_info"]["optimizer"] == _optimizer(name), (rank, r["info"])
        assert r["keys"] > 5, "the snapshot holds the restored fields"
        assert r["before"] == [], (rank, r["before"])
        assert r["client"] == [], (rank, r["client"])
        assert r["payload"] == ([], []), (rank, r["payload"])
        assert r["after"] == [], (rank, r["after"])
        assert r["loss"][0] == r["loss"][1], (rank, r["loss"])
        _check_restored_extras(r, cfg, rank)
        _check_model_state_reads(r["info"], rank)
        # DeepSpeed's own load read the same files whole (the record sees it): what pyckpt saves
        stock = r["stock_info"]["reads"]
        assert {x["path"] for x in stock} == {x["path"] for x in r["info"]["reads"]}, (rank, stock)
        assert all(not x["mmap"] and x["weights_only"] is False for x in stock), (rank, stock)
        if cfg.stage < 3:
            assert all(x["materialised"] == x["module_tensors"] > 0 for x in stock), (rank, stock)


@pytest.mark.parametrize("name,ws", PAIRS, ids=[f"{n}-{w}" for n, w in PAIRS])
def test_each_rank_reads_exactly_its_own_share(loads, name, ws):
    for rank, r in enumerate(loads[name, ws]):
        assert r["info"]["bytes_read"] == r["info"]["own_bytes"], (rank, r["info"])


def _masked_diff(truth: dict, got: dict) -> list:
    """Field-by-field differences, leaving out what a run without checkpoint leaves uninitialised
    (ZeRO-3 per-parameter padding of the fp32 partitions, of their moments and of what is cast from
    them)."""
    out = []
    for key in sorted(truth):
        if key.startswith("mask/") or key.startswith("global_s"):
            continue
        x, y = truth[key], got.get(key)
        mask = truth.get(f"mask/{key.rsplit('/fp32', 1)[0]}") if key.endswith("/fp32") else \
            truth.get(f"mask/{key}") if key.startswith(("ds_tensor/", "lp_flat")) else None
        if key.startswith("lp_flat"):
            mask = truth.get(f"mask/flat{key[len('lp_flat'):]}")
        if key.startswith("flat") and "/state/" in key and not key.endswith("/step"):
            # a moment's padding holds whatever Adam made of the padding's gradient, which a run
            # without checkpoint leaves uninitialised
            mask = truth.get(f"mask/{key.split('/', 1)[0]}")
        if torch.is_tensor(x):
            if not torch.is_tensor(y) or x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"{key}: {x!r} vs {y!r}"[:200])
            elif not torch.equal(x[mask] if mask is not None else x, y[mask] if mask is not None else y):
                out.append(f"{key}: values differ")
        elif x != y:
            out.append(f"{key}: {x!r} vs {y!r}"[:200])
    return out


@pytest.mark.parametrize("name", ["z3-fp32-subgroups", "z3-fp32-groups", "z3-fp32-autoep", "z2-fp32-groups"])
def test_fixed_fields_match_a_run_without_checkpoint(universal, name):
    """Loaded at the world size it was saved at, then stepped once, pyckpt's state is the state of the
    same training continued without a checkpoint, where DeepSpeed 0.19.8's own load is wrong:
    ZeRO-3 shares one step tensor across sub-groups (3 -> 5 in one step) and gives every param group
    group 0's hyper-parameters (an AutoEP expert group even group 0's name, so the next step treats
    the experts as dense); ZeRO-1/2 fails with IndexError on a rank whose partition of a group is
    padding only."""
    cfg = CASES[name][0]
    root = str(universal[name].root)
    tasks = [_call("truth", cfg), _call("with_backend", cfg, root=root, tag=TAG)]
    if cfg.stage == 3:
        tasks.append(_call("run", cfg, root=root, tag=TAG, keep=("/state/step", "/hyper")))
    truth, got, *stock = _launch(cfg.world_size, tasks, None, f"{name} truth", 300)
    for rank in range(cfg.world_size):
        t, g = truth["ranks"][rank], got["ranks"][rank]
        assert g["info"]["backend"] == "pyckpt"
        assert _masked_diff(t["before"], g["before"]) == [], rank
        assert t["loss"] == g["loss"], rank
        assert _masked_diff(t["after"], g["after"]) == [], rank
        hyper = {k: v for k, v in g["before"].items() if k.endswith("/hyper")}
        if cfg.groups:
            # the scheduler's lr at iteration 2 of the linear warm-up (0.1 + 0.9 * 2/4 of the top),
            # the bias group's own
            assert len(hyper) == 2 and hyper["group1/hyper"]["lr"] == pytest.approx(0.55 * 3e-3), hyper
        steps = {k: v.item() for k, v in g["after"].items() if k.endswith("/state/step")}
        assert set(steps.values()) == {4.0}, steps
        if cfg.stage == 3:
            assert len(steps) >= 2, "more than one sub-group"
            # The defect pyckpt corrects, seen in the same launch.
            before_diffs, after_diffs = stock[0]["ranks"][rank]["before"], stock[0]["ranks"][rank]["after"]
            assert any("/state/step" in d and "tensor(5.)" in d for d in after_diffs), after_diffs
            if name == "z3-fp32-groups":
                lr0 = hyper["group0/hyper"]["lr"]
                assert any(d.startswith(f"group1/hyper: {{'lr': {lr0!r}") for d in before_diffs), before_diffs
            if name == "z3-fp32-autoep":
                # the expert group is named after its expert-parallel group; DeepSpeed renames it group 0's
                assert hyper["group1/hyper"]["name"] == "ep_size_2", hyper
                assert any(d.startswith("group1/hyper: {'name': 'dense-params'") for d in before_diffs), before_diffs
    if cfg.stage != 3:
        # the padding-only partition: rank 3 holds 4 of the bias group's 16 padded elements, 10 real
        assert any(k.startswith("group1") for k in got["ranks"][3]["before"])
        with pytest.raises(RuntimeError, match="IndexError"):
            _launch(cfg.world_size, [_call("run", cfg, root=root, tag=TAG)], None, f"{name} stock", 300)


@_batched
def _cannot_plan(universal, tmp):
    name = "z1-fp32"
    root = tmp / name
    shutil.copytree(universal[name].root, root)
    damaged = root / TAG / "zero" / "l1.bias" / "exp_avg.pt"
    damaged.write_bytes(damaged.read_bytes()[:200])
    cfg = dataclasses.replace(CASES[name][0], world_size=3)
    return [(0, 3, _call("failing", cfg, root=str(root), tag=TAG))], damaged


def test_a_rank_that_cannot_plan_fails_every_rank_and_changes_nothing(batched):
    """A state file only rank 2's partition needs is cut short: rank 2 names it, ranks 0 and 1 name
    rank 2, and no rank's optimizer state changed (none waits in DeepSpeed's later collectives)."""
    results, damaged = batched["_cannot_plan"]
    ranks = results[0]["ranks"]
    owners = [r for r, x in enumerate(ranks) if x["error"][0] == "CheckpointFormatError"]
    assert owners == [2], ranks
    assert ranks[2]["error"][1].startswith(os.fspath(damaged)), ranks[2]["error"]
    for rank, x in enumerate(ranks):
        assert x["changed"] == [], (rank, x["changed"])
        if rank != 2:
            assert x["error"][0] == "RankLoadError" and "rank 2" in x["error"][1], x["error"]


# (case, parameter, state file removed): a moment or a master missing for one parameter while the
# others of its group have theirs, under each ZeRO-1/2 optimizer class
MISSING = [("z1-fp32", "l0.weight", "exp_avg"), ("z1-fp32", "l1.weight", "fp32"),
           ("bf16_optimizer", "l0.weight", "exp_avg_sq"), ("z2-bf16", "l1.bias", "exp_avg")]


@_batched
def _missing_state_file(universal, tmp):
    items, removed = [], []
    for i, (name, param, key) in enumerate(MISSING):
        root = tmp / f"{i}-{name}"
        shutil.copytree(universal[name].root, root)
        path = root / TAG / "zero" / param / f"{key}.pt"
        path.unlink()
        removed.append(path)
        items.append((i, 3, _call("failing", _target(CASES[name][0], 3), root=str(root), tag=TAG)))
    return items, removed


def test_a_missing_state_file_fails_every_rank_and_changes_nothing(batched):
    """One parameter's exp_avg.pt (exp_avg_sq.pt, fp32.pt) removed while the other parameters keep
    theirs: the ranks whose partition holds it name the missing file (DeepSpeed's own message for a
    moment, as its map_to_flat_opt_states raises it), the others name those ranks, and no rank's state
    changed. Before, the load succeeded with that parameter's moment zero on every rank."""
    results, removed = batched["_missing_state_file"]
    for i, ((name, param, key), path) in enumerate(zip(MISSING, removed)):
        ranks = results[i]["ranks"]
        owners = [r for r, x in enumerate(ranks) if x["error"] and x["error"][0] != "RankLoadError"]
        assert owners, (name, key, ranks)
        for rank, x in enumerate(ranks):
            assert x["changed"] == [], (name, key, rank, x["changed"])
            kind, message = x["error"]
            if rank in owners:
                expected = ("CheckpointFormatError", f"{path}: missing") if key == "fp32" else \
                    ("ValueError", f"{key} not found in optimizer state fragment: {path} is missing")
                assert kind == expected[0] and message.startswith(expected[1]), (name, key, rank, x["error"])
            else:
                assert kind == "RankLoadError" and f"rank {owners[0]}" in message, (name, key, rank, x["error"])


def _per_rank_copy(src: Path, dst: Path, damage) -> str:
    shutil.copytree(src, dst)
    damage(dst)
    return str(dst)


def test_a_file_that_fails_on_one_rank_only_fails_every_rank_promptly(universal, tmp_path):
    """A checkpoint that differs between ranks (one node sees a damaged copy): the rank whose read
    fails names its file, the others name that rank, all at once (each rank catches the error and
    goes on, as a training script might: before, the others waited in pyckpt's agreement until the
    process group's timeout), and no rank's state changed, counters and scheduler included. The reads
    DeepSpeed makes before the optimizer load (the model-state file, latest_universal; latest and the
    tag folder of a direct resume) are made ahead, inside an agreed step."""
    import datetime

    name = "z1-fp32"
    src = universal[name].root
    cfg = _target(CASES[name][0], 3)
    model = Path(TAG) / "mp_rank_00_model_states.pt"

    def truncate(root):
        data = (root / model).read_bytes()
        (root / model).write_bytes(data[:len(data) // 2])

    def unsafe(root):
        saved = torch.load(root / model, weights_only=False)  # the test's own file
        saved["hook"] = datetime.timedelta(days=1)  # off the allowlist: refused, not unpickled
        torch.save(saved, root / model)

    def no_pointer(root):  # with `latest` there, the load would resume from the ZeRO checkpoint it names
        (root / "latest_universal").unlink()
        (root / "latest").unlink()

    def bad_latest(root):
        shutil.rmtree(root / TAG)
        (root / "latest").write_text("global_step9")

    cases = [  # (damage, damaged rank, tag, way, expected error on that rank, what it names)
        (truncate, 1, TAG, "pyckpt", "CheckpointFormatError", "mp_rank_00_model_states.pt: "),
        (unsafe, 2, TAG, "pyckpt", "UnsafePickleError", "mp_rank_00_model_states.pt"),
        (no_pointer, 0, None, "pyckpt", "ValueError", "latest_universal does not exist"),
        (bad_latest, 1, None, "direct", "CheckpointFormatError", "global_step9"),
    ]
    tasks = []
    for i, (damage, rank, tag, way, _, _) in enumerate(cases):
        root = _per_rank_copy(src, tmp_path / f"{i}-rank{rank}", damage)
        tasks.append(_call("failing_each_way", cfg, root=str(src), rank_roots={str(rank): root}, tag=tag,
                           ways=(way, )))
    for (damage, rank, tag, way, kind, names), res in zip(cases, _launch(3, tasks, None, "one rank fails", 240)):
        for r, x in enumerate(res["ranks"]):
            got = x[way]
            assert got["changed"] == [], (damage.__name__, r, got["changed"])
            error_kind, message = got["error"]
            if r == rank:
                assert error_kind == kind and names in message, (damage.__name__, r, got["error"])
                assert str(tmp_path) in message or kind == "ValueError", (damage.__name__, message)
            else:
                assert error_kind == "RankLoadError" and f"failed on rank {rank} ({kind}" in message, \
                    (damage.__name__, r, got["error"])


FUZZ_LOADS = max(8, int(os.environ.get("PYCKPT_FUZZ_EXAMPLES", "1000")) // 40)


def _damage_state_files(rnd, root: Path, outside: Path) -> str:
    """One hostile change to a universal folder's state files: missing, extra, linked (out of the
    checkpoint, to /proc, or to another file inside), truncated. Returns what was done."""
    zero = root / TAG / "zero"
    params = sorted(p.name for p in zero.iterdir() if p.is_dir())
    param = rnd.choice(params)
    files = sorted(p.name for p in (zero / param).iterdir())
    victim = rnd.choice(files + ["../optimizer_state.pt"])
    path = zero / param / victim
    how = rnd.choice(["missing", "extra", "extra-folder", "link-outside", "link-proc", "link-inside", "truncated"])
    if how == "missing":
        path.unlink()
    elif how == "extra":
        shutil.copyfile(zero / param / "fp32.pt", zero / param / rnd.choice(["momentum.pt", "exp_avg2.pt", "x.pt"]))
    elif how == "extra-folder":
        (zero / "not.in.the.model").mkdir()
        shutil.copyfile(zero / param / "fp32.pt", zero / "not.in.the.model" / "fp32.pt")
    elif how.startswith("link"):
        copy = outside / f"{param}-{path.name}"
        shutil.copyfile(path, copy)
        path.unlink()
        other = zero / rnd.choice([p for p in params if p != param]) / path.name
        os.symlink({"link-outside": str(copy), "link-proc": "/proc/self/environ", "link-inside": str(other)}[how], path)
    else:
        data = path.read_bytes()
        path.write_bytes(data[:rnd.randrange(len(data))])
    return f"{how} {param}/{victim}"


@pytest.mark.fuzz
def test_fuzz_universal_load_state_files(universal, tmp_path):
    """Fuzzing the load backend's state files, derandomized: each input damages one state file of a
    universal folder (missing, extra, linked, truncated), on every rank or on one rank's copy only
    (a checkpoint that differs between ranks), and loads it with pyckpt at another world size. Every
    rank must end the same way: all load, or all raise (a pyckpt error naming the file, DeepSpeed's
    own error for what its load refuses, or RankLoadError naming the failing rank) with no state
    changed; and nothing may hang. PYCKPT_FUZZ_EXAMPLES / 40 inputs (at least 8), one launch."""
    import random

    rnd = random.Random(21)
    outside = tmp_path / "outside"
    outside.mkdir()
    tasks, what = [], []
    for i in range(FUZZ_LOADS):
        name = rnd.choice(["z1-fp32", "z2-bf16", "bf16_optimizer"])
        src = universal[name].root
        root = tmp_path / f"{i}"
        shutil.copytree(src, root)
        done = _damage_state_files(rnd, root, outside)
        one = rnd.choice([None, 0, 1, 2])
        extra = {"root": str(root)} if one is None else {"root": str(src), "rank_roots": {str(one): str(root)}}
        tasks.append(_call("failing_each_way", _target(CASES[name][0], 3), tag=TAG, ways=("pyckpt", ), **extra))
        what.append((name, done, "every rank" if one is None else f"rank {one} only"))
    # pyckpt's errors, and DeepSpeed's own where pyckpt runs DeepSpeed's checks (its restore-metadata
    # resolvers assert on a slice that does not fit, naming the file)
    allowed = {"CheckpointFormatError", "RankLoadError", "ValueError", "UnsafePickleError",
               "UnsupportedCheckpointError", "AssertionError"}
    outcomes = {}
    for w, res in zip(what, _launch(3, tasks, None, "fuzz universal load", 600)):
        errors = [x["pyckpt"]["error"] for x in res["ranks"]]
        outcomes[w] = "ok" if all(e is None for e in errors) else sorted({e[0] for e in errors if e})
        assert all(e is None for e in errors) or all(e is not None for e in errors), (w, errors)
        for r, x in enumerate(res["ranks"]):
            e = x["pyckpt"]["error"]
            if e is None:
                continue
            assert x["pyckpt"]["changed"] == [], (w, r, x["pyckpt"]["changed"])
            assert e[0] in allowed and "\n" not in e[1].split(" (")[0], (w, r, e)
            assert e[0] == "RankLoadError" or str(tmp_path) in e[1] or e[0] == "ValueError", (w, r, e)
    print(outcomes)


@pytest.fixture(scope="session")
def direct_loads(launched):
    return launched["direct"]


@pytest.mark.parametrize("name,target", DIRECT, ids=DIRECT_IDS)
def test_resuming_from_the_zero_checkpoint_equals_convert_then_load(direct_loads, name, target):
    """No universal folder: pyckpt.deepspeed.load_checkpoint(engine, dir) on an engine without
    load_universal, engine.load_checkpoint(dir, tag) with load_universal and the backend enabled, and
    a plain engine.load_checkpoint(dir) under enable() on the engine as configured for training (the
    topology differs from the saved one, so it reshards, saying so once on rank 0) restore the state
    the converted folder gives, field by field, before and after one more step; each rank gathers
    exactly its share, from the ZeRO shards."""
    ranks = direct_loads[name, _tid(target)]
    cfg = CASES[name.removesuffix("-nouc")][0]
    assert len(ranks) == _target(cfg, target).world_size
    for rank, r in enumerate(ranks):
        log = r["reshard"]["info"]["log"]
        if rank == 0:
            assert len(log) == 1 and log[0].startswith("pyckpt: resharding ") and "/global_step3 from ZeRO-" in log[0], log
        else:
            assert log == [], (rank, log)
        for how in ("api", "enable", "reshard"):
            x = r[how]
            assert x["info"]["backend"] == "pyckpt", (rank, how, x["info"])
            assert x["info"]["optimizer"] == _optimizer(name), (rank, how, x["info"])
            assert x["keys"] > 5
            assert x["before"] == [], (rank, how, x["before"])
            assert x["after"] == [], (rank, how, x["after"])
            assert x["loss"][0] == x["loss"][1], (rank, how, x["loss"])
            # ds_to_universal rewrites an AutoEP ZeRO-1/2 checkpoint's universal_checkpoint_info (the expert
            # patterns it adds) in the model-state file it copies; a direct resume returns the saved one
            rewritten = ["universal_checkpoint_info"] if name == "z1-fp32-autoep" else []
            assert x["client_diff"] == rewritten, (rank, how, x["client"])
            assert x["payload"] == [], (rank, how, x["payload"])
            _check_restored_extras(x, cfg, (rank, how))
            _check_model_state_reads(x["info"], (rank, how))
            assert x["info"]["bytes_read"] == x["info"]["own_bytes"], (rank, how, x["info"])
            assert "/global_step3/" in x["info"]["path"] and "universal" not in x["info"]["path"], x["info"]["path"]


@_batched
def _plain_same(universal, tmp):
    return [(name, 2, _call("plain_same", CASES[name][0], root=str(universal[name].root), tag=None))
            for name in ("z2-bf16", "z3-bf16")], None


def test_a_plain_load_at_the_saved_topology_stays_deepspeeds_own(batched):
    """Under enable(), a plain engine.load_checkpoint(dir) at the topology the checkpoint was saved at is
    DeepSpeed's own load: the same state before and after one more step as without pyckpt, no load of
    pyckpt's recorded, nothing logged."""
    results, _ = batched["_plain_same"]
    assert sorted(results) == ["z2-bf16", "z3-bf16"]
    for name, res in results.items():
        for rank, x in enumerate(res["ranks"]):
            assert x["before"] == [] and x["after"] == [], (name, rank, x["before"], x["after"])
            assert x["loss"][0] == x["loss"][1], (name, rank, x["loss"])
            assert "backend" not in x["info"] and x["info"]["log"] == [], (name, rank, x["info"])


@_batched
def _topology_change(universal, tmp):
    name = "z2-bf16"
    root = str(universal[name].root)
    z3 = dataclasses.replace(CASES[name][0], stage=3, world_size=3)
    z2 = dataclasses.replace(CASES[name][0], world_size=3)
    return [("stage", 3, _call("failing_each_way", z3, root=root, tag=None, ways=["plain"])),
            ("off", 3, _call("failing_each_way", z2, root=root, tag=None, ways=["plain_off"]))], None


def test_a_topology_change_that_cannot_be_served_fails_every_rank_naming_both(batched):
    """A plain load under enable() of a ZeRO-2 checkpoint (saved at data-parallel 2) into a ZeRO-3
    engine at 3 ranks: every rank raises UnsupportedCheckpointError naming the saved and the current
    topology and what would serve it, before any state changed. With enable(reshard=False) the same
    load at ZeRO-2 is DeepSpeed's own, which refuses the new data-parallel size itself."""
    results, _ = batched["_topology_change"]
    stage_change, opted_out = results["stage"], results["off"]
    for rank, x in enumerate(stage_change["ranks"]):
        kind, message = x["plain"]["error"]
        assert kind == "UnsupportedCheckpointError", (rank, x)
        assert "was saved at ZeRO-2, data-parallel 2, tensor-parallel 1" in message, message
        assert "this engine runs ZeRO-3, data-parallel 3, tensor-parallel 1" in message, message
        assert "run with ZeRO-2" in message, message
        assert x["plain"]["changed"] == [], (rank, x["plain"]["changed"])
    for rank, x in enumerate(opted_out["ranks"]):
        kind, message = x["plain_off"]["error"]
        assert kind == "ZeRORuntimeException" and "DP world size of 2" in message, (rank, x)


class _Marker:
    """Unpickled by a reader that runs what a pickle names, it creates its file (builtins.open)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _resave(path: Path, change) -> None:
    saved = torch.load(path, weights_only=False)  # the test's own file
    change(saved)
    torch.save(saved, path)


UNSAFE = {  # name: (the file made hostile, world size loaded at, way)
    "reshard": ("global_step3/mp_rank_00_model_states.pt", 3, "plain"),
    "saved-topology": ("global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", 2, "plain"),
    "reshard-off": ("global_step3/mp_rank_00_model_states.pt", 2, "plain_off"),
}


@_batched
def _unsafe_pickle(universal, tmp):
    src = universal["z2-bf16"].root
    cfg = CASES["z2-bf16"][0]
    items = []
    for name, (victim, ws, way) in UNSAFE.items():
        root = tmp / name
        shutil.copytree(src, root)
        marker = tmp / f"{name}.ran"
        if victim.endswith("optim_states.pt"):
            _resave(root / victim, lambda saved: saved["optimizer_state_dict"].update(hook=_Marker(marker)))
        else:
            _resave(root / victim, lambda saved: saved.update(hook=_Marker(marker)))
        items.append((name, ws, _call("failing_each_way", dataclasses.replace(cfg, world_size=ws), root=str(root),
                                      tag=None, ways=[way])))
    return items, tmp


def test_under_enable_a_file_pyckpt_refuses_is_refused_by_every_load(batched):
    """A checkpoint file whose pickle would run code (here: create a marker file) is refused on every
    rank with UnsafePickleError before DeepSpeed's unpickler sees it, whichever road the plain
    engine.load_checkpoint(dir) under enable() takes: a reshard (the model-state file, which the
    topology is read from), DeepSpeed's own load at the saved topology (a ZeRO shard), and
    enable(reshard=False). No marker appears and no rank's state changes."""
    results, tmp = batched["_unsafe_pickle"]
    assert sorted(results) == sorted(UNSAFE)
    for name, (victim, ws, way) in UNSAFE.items():
        res = results[name]
        assert len(res["ranks"]) == ws
        assert not (tmp / f"{name}.ran").exists(), name
        for rank, x in enumerate(res["ranks"]):
            kind, message = x[way]["error"]
            assert kind == "UnsafePickleError", (name, rank, x)
            assert os.path.basename(victim) in message and "io.open" in message, (name, rank, message)
            assert "trust_pickles=True" in message, message
            assert x[way]["changed"] == [], (name, rank, x[way]["changed"])


@_batched
def _lying_topology(universal, tmp):
    items, roots = [], {}
    for name in ("z2-fp32-groups", "z3-bf16-frozen_tied"):
        cfg = CASES[name][0]
        assert cfg.world_size == 4
        root = tmp / name
        shutil.copytree(universal[name].root, root)
        for path in (root / "global_step3").glob("*model_states.pt"):
            _resave(path, lambda saved: saved.update(dp_world_size=2))
        roots[name] = root
        items.append((name, 2, _call("failing_each_way", dataclasses.replace(cfg, world_size=2), root=str(root),
                                     tag=None, ways=["plain"])))
    return items, roots


def test_a_model_state_file_whose_topology_lies_is_refused_before_anything_loads(batched):
    """A checkpoint saved at data-parallel 4 whose model-state files say 2, loaded at 2 under enable():
    by its metadata it is at the engine's topology and DeepSpeed's own load would take it, reading
    half the shards into the wrong slices without a word. The shards are counted and their
    partition_count read first: every rank refuses, naming dp_world_size and the shards, and no
    state changes (ZeRO-2 and ZeRO-3)."""
    results, roots = batched["_lying_topology"]
    assert sorted(results) == sorted(roots)
    for name, res in results.items():
        for rank, x in enumerate(res["ranks"]):
            kind, message = x["plain"]["error"]
            assert kind == "CheckpointFormatError", (name, rank, x)
            assert "dp_world_size is 2, but the checkpoint's shards are cut for 4 data-parallel ranks" in message, message
            assert str(roots[name]) in message, message
            assert x["plain"]["changed"] == [], (name, rank, x["plain"]["changed"])


@_batched
def _different_options(universal, tmp):
    name = "z2-bf16"
    return [(0, 2, _call("failing_each_way", CASES[name][0], root=str(universal[name].root), tag=None,
                         ways=["plain_mixed"]))], None


def test_ranks_that_pass_different_load_options_are_refused_together(batched):
    """engine.load_checkpoint is collective: ranks passing different options (optimizer states on rank
    0 only) would read different things or part ways in DeepSpeed's collectives. Under enable() they
    are compared first: every rank raises RankLoadError naming the values, nothing changed."""
    res = batched["_different_options"][0][0]
    assert len(res["ranks"]) == 2
    for rank, x in enumerate(res["ranks"]):
        kind, message = x["plain_mixed"]["error"]
        assert kind == "RankLoadError" and "the ranks disagree" in message, (rank, x)
        assert "load_optimizer_states" in message, message
        assert x["plain_mixed"]["changed"] == [], (rank, x["plain_mixed"]["changed"])


@_batched
def _broken_zero(universal, tmp):
    name = "z1-fp32"
    root = tmp / name
    shutil.copytree(universal[name].root, root, ignore=shutil.ignore_patterns(TAG))
    damaged = root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    damaged.write_bytes(damaged.read_bytes()[:200])
    cfg = dataclasses.replace(CASES[name][0], world_size=3)
    return [(0, 3, _call("failing", cfg, root=str(root), tag="global_step3"))], damaged


def test_a_broken_zero_checkpoint_fails_every_rank_and_changes_nothing(batched):
    """Resuming straight from a ZeRO checkpoint with a cut-short shard: every rank reads every shard's
    metadata to build the view, so every rank names the file, and no rank's optimizer state changed."""
    results, damaged = batched["_broken_zero"]
    res = results[0]
    assert len(res["ranks"]) == 3
    for rank, x in enumerate(res["ranks"]):
        assert x["error"][0] == "CheckpointFormatError" and os.fspath(damaged) in x["error"][1], (rank, x["error"])
        assert x["changed"] == [], (rank, x["changed"])


@pytest.fixture(scope="session")
def wide(saved):
    return {name: saved[name] for name in PAGE_CASES}


PAGE_HOWS = ("universal", "direct")


@pytest.fixture(scope="module")
def page_counts(wide):
    """Every (case, how) counted in one launch: each task evicts the files it reads before every rank's turn."""
    keys = [(name, how) for name in PAGE_CASES for how in PAGE_HOWS]
    tasks = [_call("pages", dataclasses.replace(PAGE_CASES[name], world_size=3), root=str(wide[name].root), tag=TAG,
                   how=how) for name, how in keys]
    return dict(zip(keys, _launch(3, tasks, None, "pages", 300 * len(tasks))))


@pytest.mark.parametrize("how", PAGE_HOWS)
@pytest.mark.parametrize("name", list(PAGE_CASES))
def test_each_rank_brings_only_its_share_into_the_page_cache(page_counts, name, how):
    """Ranks gather in turn from evicted files; mincore counts what each one's gather brought in: its
    own share (12 bytes per element its partitions hold), give or take page rounding at the ends of
    each run (DeepSpeed's loader brings in every file it opens whole: all of them under ZeRO-3, 3x
    the share here)."""
    res = page_counts[name, how]
    assert len(res["ranks"]) == 3
    for rank, r in enumerate(res["ranks"]):
        assert r["baseline"] < r["file_bytes"] // 20, ("the page cache kept the files: the count would mean nothing", r)
        assert r["gathered"] == r["own_bytes"], r
        # the bound, 1.05x the share: each run may round out to a page at both ends (ZeRO-3
        # shards hold a rank's elements in a dozen runs per file here: 16 pages over, 1.6%)
        assert r["own_bytes"] * 0.98 <= r["touched"] <= r["own_bytes"] * 1.05, (rank, r)


@_batched
def _expert_count_mismatch(universal, tmp):
    name = "z1-fp32-autoep"
    root = tmp / name
    shutil.copytree(universal[name].root, root)
    state = root / TAG / "zero" / "model.layers.0.mlp.experts.w1" / "fp32.pt"
    saved = torch.load(state, weights_only=False)  # the test's own file
    saved["ep_num_experts"] = 6
    torch.save(saved, state)
    cfg = _target(CASES[name][0], {"world_size": 4, "ep_size": 4})
    return [(0, 4, _call("failing", cfg, root=str(root), tag=TAG))], None


def test_an_expert_count_mismatch_fails_with_deepspeeds_error(batched):
    """A universal expert state whose ep_num_experts disagrees with the target model's experts: every
    rank raises DeepSpeed's own ValueError (its resolver checks the metadata first), none changed its
    state."""
    res = batched["_expert_count_mismatch"][0][0]
    assert len(res["ranks"]) == 4
    for rank, x in enumerate(res["ranks"]):
        assert x["error"] == ("ValueError", "AutoEP universal checkpoint expert count disagrees with target logical "
                              "shape: checkpoint=6, target=(8, 6, 10)."), (rank, x["error"])
        assert x["changed"] == [], (rank, x["changed"])


def _with_experts(src: Path, dst: Path, n: int) -> None:
    """A copy of a universal AutoEP checkpoint whose every expert state file holds n experts (the
    first n rows, repeated where n exceeds them) and says so in ep_num_experts."""
    shutil.copytree(src, dst)
    files = sorted(f for f in (dst / TAG / "zero").glob("*.experts.w*/*.pt") if f.stem != "step")
    assert len(files) == 2 * 3 * 3, files  # 2 layers x w1/w2/w3 x fp32/exp_avg/exp_avg_sq
    for f in files:
        saved = torch.load(f, weights_only=False)  # the test's own file
        rows = saved["param"]
        saved["param"] = rows.repeat((n + len(rows) - 1) // len(rows), *([1] * (rows.dim() - 1)))[:n].clone()
        saved["ep_num_experts"] = n
        torch.save(saved, f)


EXPERT_SPLITS = (4, 2)  # autoep_size of the target


@_batched
def _expert_split(universal, tmp):
    items = []
    for name in ("z1-fp32-autoep", "z3-fp32-autoep"):
        root = tmp / name
        _with_experts(universal[name].root, root, 6)
        cfg = CASES[name][0]
        items += [((name, ep), 4, _call("failing_each_way", _target(cfg, {"world_size": 4, "ep_size": ep}),
                                        root=str(root), tag=TAG, ways=("stock", "pyckpt"))) for ep in EXPERT_SPLITS]
    return items, None


@pytest.mark.parametrize("name", ["z1-fp32-autoep", "z3-fp32-autoep"])
def test_an_expert_split_the_target_cannot_take_fails_as_deepspeeds_load_does(batched, name):
    """A universal checkpoint of 6 experts loaded by the 8-expert model: at autoep_size 4 the 6 do
    not divide among the EP ranks, at autoep_size 2 they give 3 per rank where the model holds 4.
    pyckpt's load raises on every rank what DeepSpeed's own load raises in the same ranks (type and
    message), and changes no optimizer state."""
    results = batched["_expert_split"][0]
    # what DeepSpeed's resolver says in each case: the count, or the per-rank count, that does not fit
    says = {4: "checkpoint=6, target=(8, ", 2: "target_local_experts=4, checkpoint_local_experts=3"}
    for ep in EXPERT_SPLITS:
        res = results[name, ep]
        assert len(res["ranks"]) == 4
        for rank, x in enumerate(res["ranks"]):
            stock, got = x["stock"]["error"], x["pyckpt"]["error"]
            assert stock is not None and says[ep] in stock[1], (ep, rank, stock)
            assert got == stock, (ep, rank, got, stock)
            assert x["pyckpt"]["changed"] == [], (ep, rank, x["pyckpt"]["changed"])


@_batched
def _module_only(universal, tmp):
    name, ws = "z3-bf16", 3
    cfg = _target(CASES[name][0], ws)
    return [(0, ws, _call("run", cfg, root=str(universal[name].root), tag=TAG,
                          load_kwargs={"load_optimizer_states": False}))], None


def test_a_zero3_module_only_load_equals_deepspeeds(batched):
    """``load_optimizer_states=False`` on ZeRO-3 (DeepSpeed's module-only universal load: fp32 masters
    into the parameter partitions, the optimizer's moments left as they are) at another world size:
    the same state as DeepSpeed's, before and after one more step."""
    res = batched["_module_only"][0][0]
    assert len(res["ranks"]) == 3
    for rank, r in enumerate(res["ranks"]):
        assert r["info"]["backend"] == "pyckpt", (rank, r["info"])
        assert r["keys"] > 5 and r["before"] == [] and r["after"] == [], (rank, r["before"], r["after"])
        assert r["loss"][0] == r["loss"][1], (rank, r["loss"])
        assert r["info"]["bytes_read"] > 0, "the fp32 masters came through pyckpt's gather"

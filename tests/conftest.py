"""Session fixtures: real DeepSpeed 0.19.8 checkpoints made on CPU, and both converters' outputs.

Making checkpoints dominates the suite's time, so every configuration is trained once per session
(batched into one launch per world size by the harness) and tests that damage a checkpoint work on
a copy.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest

# Test files live in one folder per package folder they test (tests/README.md); the modules they share
# are imported by name, so the helpers, the workers (some are imported as well as run) and the harness
# must be importable before any test module is: pytest only puts each test file's own folder on sys.path.
TESTS = Path(__file__).resolve().parent
for _folder in (TESTS / "workers", TESTS / "helpers", TESTS):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import dsharness  # noqa: E402
from dsharness import Config  # noqa: E402

def pytest_configure(config):
    # pytest-xdist (3.x) orders files by their number of tests unless told not to, which put the long files
    # with few tests (FIRST) last; this suite orders its files itself (pytest_collection_modifyitems).
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False
    # scripts/sanitize.sh: refuse to report a pass for a run that did not load the instrumented module.
    if os.environ.get("PYCKPT_EXPECT_SANITIZED"):
        from pyckpt import _core
        with open("/proc/self/maps") as f:
            maps = f.read()
        if "build/sanitize" not in _core.__file__ or "libasan" not in maps:
            raise pytest.UsageError(f"PYCKPT_EXPECT_SANITIZED is set but {_core.__file__} is not the sanitizer build "
                                    "or ASan is not loaded")


# Fixtures that train with DeepSpeed or run its converter: a test using one is `slow`, so
# `pytest -m "not slow"` runs the rest in seconds.
DEEPSPEED_FIXTURES = {"dcp_sources", "dcp_references", "checkpoints", "deepspeed_universal", "pyckpt_universal", "ds_root", "ds_environ",
                      "dsh_checkpoints", "dsh_universal", "dsh_loaded", "generated"}
# Tests that launch DeepSpeed or a benchmark themselves.
SLOW_TESTS = {"test_failing_rank_fails_the_launch_fast", "test_structure_matches_real_deepspeed_saves",
              "test_run_quick", "test_run_quick_export"}


# The longest files first (their seconds in a 3-process run on 2 cores, 2026-11-28, less what was cut since, from
# measurements alone), so that none of them starts while the other processes are finishing: a file runs on one
# process from start to end (--dist loadfile), and one started last (a compile, a benchmark) was the run's whole
# tail. The others keep collection order and fill in behind them; they also keep every process busy while one of
# them builds the shared checkpoints (built_once).
FIRST = ("test_enable_save.py",        # ~740 s
         "test_load_backend.py",       # ~460
         "test_memory_nodes.py",       # ~350
         "test_docs.py",               # ~300
         "test_benchmarks_quick.py",   # ~260
         "test_memory_tier.py",        # ~240
         "test_build_options.py",      # ~200: a release build of the native module from scratch
         "test_hf_client.py",          # ~200
         "test_dcp_import.py",         # ~180
         "test_dsharness.py",          # ~140
         "test_reshard_clients.py",    # ~120
         "test_fuzz.py",               # ~120
         "test_save_glue.py",          # ~120
         "test_distributed_convert.py",  # ~115
         "test_async_save.py",         # ~115
         "test_memory_trainer.py",     # ~85
         "test_demo.py",               # ~75
         "test_torch_save_file.py",    # ~70
         "test_dcp_to_universal.py",   # ~50
         "test_trl_client.py",         # ~45: two launches, each four SFTTrainer jobs
         "test_make_checkpoint.py",    # ~40
         "test_device_scripts.py",     # ~40
         "test_native_faults.py",      # ~40
         "test_properties.py")         # ~30


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order
    for item in items:
        if DEEPSPEED_FIXTURES & set(getattr(item, "fixturenames", ())) or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# name -> configuration. Names say stage, dtype, dp degree and what is special.
CONFIGS = {
    "s1_fp32_dp2": Config(1, "fp32", 2),
    "s2_bf16_dp2": Config(2, "bf16", 2),
    "s3_fp32_dp2_subgroups": Config(3, "fp32", 2, sub_group_size=16),
    "s2_fp32_dp3": Config(2, "fp32", 3),
    "s3_bf16_dp3": Config(3, "bf16", 3),
    "s1_fp32_dp4": Config(1, "fp32", 4),
    "s2_fp32_dp4": Config(2, "fp32", 4),
    "s3_fp32_dp4": Config(3, "fp32", 4),
    "s1_frozen_tied": Config(1, "fp32", 2, model="frozen_tied"),
    "s2_bf16_frozen_tied": Config(2, "bf16", 2, model="frozen_tied"),
    "s3_frozen_tied": Config(3, "fp32", 2, model="frozen_tied"),
    "s2_fp32_dp2_no_uc_info": Config(2, "fp32", 2, uc_info=False),
    "s3_fp32_dp3_no_uc_info": Config(3, "fp32", 3, uc_info=False),
    # bf16 + ZeRO-1 + fp32 gradient accumulation selects BF16_Optimizer: no zero_stage key, padded partitions.
    "s1_bf16_dp2_bf16_optimizer": Config(1, "bf16", 2, grad_accum_dtype="fp32"),
    # AutoEP: a two-layer Mixtral-layout MoE with 8 experts on 4 ranks, autoep_size 2.
    "ep_s1_fp32": Config(1, "fp32", 4, model="moe", ep_size=2),
    "ep_s2_bf16": Config(2, "bf16", 4, model="moe", ep_size=2),
    "ep_s2_fp32_data_before_expert": Config(2, "fp32", 4, model="moe", ep_size=2, use_data_before_expert_parallelism=True),
    "ep_s3_fp32": Config(3, "fp32", 4, model="moe", ep_size=2),
    "ep_s3_bf16": Config(3, "bf16", 4, model="moe", ep_size=2),
    # AutoTP: a tiny Llama (q/k/v/o, gate/up/down, norms, embedding, lm_head) on 4 ranks = tp 2 x dp 2.
    "tp_s1_fp32": Config(1, "fp32", 4, model="llama", tp_size=2),
    "tp_s2_bf16": Config(2, "bf16", 4, model="llama", tp_size=2),
    "tp_s3_fp32": Config(3, "fp32", 4, model="llama", tp_size=2),
    "tp_s3_bf16_kv2": Config(3, "bf16", 4, model="llama_kv2", tp_size=2),
}

# Beyond DeepSpeed: AutoTP at tp 4 with 2 KV heads leaves TP ranks 2 and 3 with empty k/v shards.
# DeepSpeed 0.19.8's ds_to_universal crashes on these (pinned in test_dsharness.py); pyckpt converts
# them, so they have no DeepSpeed reference output and are checked against the training run instead.
ZERO_WIDTH = {
    "tp4_s1_fp32_kv2": Config(1, "fp32", 4, model="llama_kv2", tp_size=4),
    "tp4_s2_bf16_kv2": Config(2, "bf16", 4, model="llama_kv2", tp_size=4),
}
# Two param groups of their own hyper-parameters (models.BIAS_GROUP), which exports keep group by group.
GROUPED = {
    "z2_groups_dp2": Config(2, "fp32", 2, groups=True),
    "z3_groups_dp3": Config(3, "fp32", 3, groups=True, sub_group_size=16),
}
ALL_CONFIGS = {**CONFIGS, **ZERO_WIDTH, **GROUPED}

# (checkpoint, world size to load it at): 4 -> 2 and 2 -> 3 for every stage.
LOADS = [
    ("s1_fp32_dp4", 2),
    ("s2_fp32_dp4", 2),
    ("s3_fp32_dp4", 2),
    ("s1_fp32_dp2", 3),
    ("s2_bf16_dp2", 3),
    ("s3_fp32_dp2_subgroups", 3),
    ("s2_bf16_frozen_tied", 3),
    ("s1_bf16_dp2_bf16_optimizer", 3),
]


def converter_args(name: str):
    return ("--inject_missing_state", ) if not ALL_CONFIGS[name].uc_info else ()


@pytest.fixture(scope="session")
def ds_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepspeed")


@pytest.fixture(scope="session")
def ds_environ(ds_root) -> dict:
    # A private TORCH_EXTENSIONS_DIR per session, so no test depends on or pollutes a shared op cache.
    return dsharness.ds_env(ds_root)


# built_once names whose folders only DeepSpeed's training and its ds_to_universal write: no pyckpt code
# runs in making them, so a run under another build of pyckpt may read them (PYCKPT_TEST_REFERENCE_DIR).
REFERENCE_DATA = {"ckpt", "ds_universal"}


def built_once(tmp_path_factory, name: str, build):
    """``build(folder)``'s result, built once per test run. Under pytest-xdist every worker process has
    a session of its own, and each would train the same checkpoints again on the same two cores: the
    first worker to ask builds them into the run's shared temporary folder under a file lock, the
    others wait for it and read its result. Tests never change these folders (they damage copies).

    With PYCKPT_TEST_REFERENCE_DIR set (.ci/run sets it for both of its runs), what DeepSpeed alone makes
    (REFERENCE_DATA) is built once for every run given that folder: scripts/sanitize.sh then reads the
    suite's checkpoints instead of training them again (DeepSpeed's processes run uninstrumented there
    anyway, dsharness.ds_env); what pyckpt makes is always made by the run's own build."""
    reference = os.environ.get("PYCKPT_TEST_REFERENCE_DIR")
    if reference and name in REFERENCE_DATA:
        shared = Path(reference) / name
    elif "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    else:
        shared = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
    import torch

    with open(f"{shared}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared.with_name(shared.name + ".pt")
        if done.exists():
            return torch.load(done, weights_only=False)  # this run's own fixture data
        shutil.rmtree(shared, ignore_errors=True)  # what a worker whose build failed left
        shared.mkdir()
        made = build(shared)
        torch.save(made, done)
        return made


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, ds_environ) -> dict:
    def build(root: Path) -> dict:
        items = [(cfg, root / name) for name, cfg in ALL_CONFIGS.items()]
        return dict(zip(ALL_CONFIGS, dsharness.make_checkpoints(items, env=ds_environ)))
    return built_once(tmp_path_factory, "ckpt", build)


@pytest.fixture(scope="session")
def deepspeed_universal(checkpoints, tmp_path_factory, ds_environ) -> dict:
    """DeepSpeed's ds_to_universal output for every checkpoint it can convert (the reference)."""
    def build(root: Path) -> dict:
        out = {}
        batches = {}
        for name, ck in checkpoints.items():
            if name in ZERO_WIDTH:
                continue
            dest = root / name / f"{ck.tag}_universal"
            batches.setdefault(converter_args(name), []).append((ck.tag_dir, dest))
            out[name] = dest
        for args, jobs in batches.items():
            dsharness.run_ds_to_universal_many(jobs, *args, env=ds_environ)
        return out
    return built_once(tmp_path_factory, "ds_universal", build)


@pytest.fixture(scope="session")
def pyckpt_universal(checkpoints, tmp_path_factory) -> dict:
    def build(root: Path) -> dict:
        import pyckpt

        out = {}
        for name, ck in checkpoints.items():
            dest = root / name / f"{ck.tag}_universal"
            pyckpt.convert_to_universal(ck.root, dest, inject_missing_state=not ALL_CONFIGS[name].uc_info)
            out[name] = dest
        return out
    return built_once(tmp_path_factory, "pyckpt_universal", build)


# Real torch.distributed.checkpoint folders saved by torch 2.13 (FSDP2, FSDP x TP, torch's sharded safetensors)
# and by torchtitan 0.3.0 on CPU (tests/helpers/dcp_sources.py launches the workers), each made once per run.
@pytest.fixture(scope="session")
def dcp_sources(tmp_path_factory) -> dict:
    """name -> DcpSource for every case of dcp_sources.CASES and "torchtitan" (about a minute of torchrun
    launches, once per run; tests read these folders and never change them)."""
    import dcp_sources as sources

    return built_once(tmp_path_factory, "dcp_sources", sources.build_all)


@pytest.fixture(scope="session")
def dcp_references(dcp_sources, tmp_path_factory) -> dict:
    """name -> the Hugging Face folder users make today of each torch-saved case (dcp_sources.reference_hf)."""
    import dcp_sources as sources

    def build(root):
        return {name: sources.reference_hf(s.dcp, root / name) for name, s in dcp_sources.items()
                if name in sources.CASES}
    return built_once(tmp_path_factory, "dcp_references", build)

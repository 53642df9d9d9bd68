"""Real torch.distributed.checkpoint folders for the DCP reader's tests, made once per session by the
workers (torchrun, gloo, CPU), and the Hugging Face folder users make of one today (the baseline
pyckpt's export must equal).

``CASES`` names each DCP checkpoint ``tests/workers/dcp_save_worker.py`` makes and how: world size and
worker arguments. A case's folder holds ``dcp/`` (the checkpoint), ``config.json`` (beside it, where
pyckpt looks) and ``reference.pt`` (the worker's full model and optimizer state at save time, the
logits of its fixed batch, the losses of three more steps). ``torchtitan_checkpoint`` makes
``tests/workers/torchtitan_save_worker.py``'s folder: ``checkpoint/step-2`` (torchtitan's layout),
``hf/config.json`` and ``reference.pt`` (torchtitan's ``to_hf`` of the model).

Each launch runs in a session of its own with its working folder outside the source tree, a port of
its own (``--standalone``), one thread per rank and a private TORCH_EXTENSIONS_DIR; a launch that
outlives its time is killed with its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"
DCP_WORKER = WORKERS / "dcp_save_worker.py"
TORCHTITAN_WORKER = WORKERS / "torchtitan_save_worker.py"
TIMEOUT_S = 300

# name -> (world size, worker arguments). World sizes 3 and 4 leave shards uneven (the worker's sizes).
CASES = {
    "llama_fsdp": (2, []),
    "llama_tied_fsdp": (3, ["--tie"]),
    "mixtral_fsdp": (3, ["--model", "mixtral"]),
    "llama_fsdp_tp": (4, ["--mesh", "fsdp_tp"]),
    "llama_hf_writer": (2, ["--writer", "hf"]),
}


@dataclass(frozen=True)
class DcpSource:
    """One worker's output folder: ``dcp`` the checkpoint, ``config`` the folder holding config.json,
    ``reference`` the worker's reference.pt; ``seconds`` how long its launch took."""

    root: Path
    dcp: Path
    config: Path
    reference: Path
    seconds: float


def torchrun(worker: Path, nproc: int, args: list, cwd: Path, timeout: float = TIMEOUT_S) -> float:
    """Runs ``worker`` on ``nproc`` ranks; returns the seconds it took, raises with its output's tail on failure."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(cwd / "torch_extensions"),
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(worker), *map(str, args)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank: they share its session
        output, _ = proc.communicate()
        raise RuntimeError(f"{worker.name} {args} ran past {timeout}s:\n{output[-4000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{worker.name} {args} exited {proc.returncode}:\n{output[-4000:]}")
    return time.monotonic() - start


def dcp_checkpoint(root: Path, name: str) -> DcpSource:
    """Case ``name`` of CASES made into ``root/name``."""
    nproc, args = CASES[name]
    out = root / name
    seconds = torchrun(DCP_WORKER, nproc, [out, *args], cwd=root / f"{name}.run")
    return DcpSource(out, out / "dcp", out, out / "reference.pt", seconds)


def torchtitan_checkpoint(root: Path, nproc: int = 2) -> DcpSource:
    """torchtitan's checkpointer's folder for its Llama3 (``dcp`` = checkpoint/step-2, ``config`` = the
    Hugging Face config's folder)."""
    out = root / "torchtitan"
    seconds = torchrun(TORCHTITAN_WORKER, nproc, [out], cwd=root / "torchtitan.run")
    return DcpSource(out, out / "checkpoint" / "step-2", out / "hf", out / "reference.pt", seconds)


def build_all(root: Path) -> dict:
    """Every case and the torchtitan checkpoint under ``root``: name -> DcpSource (torchtitan's as "torchtitan")."""
    made = {name: dcp_checkpoint(root, name) for name in CASES}
    made["torchtitan"] = torchtitan_checkpoint(root)
    return made


def config_dir(dcp_dir: Path) -> Path:
    """The folder whose config.json describes ``dcp_dir``: its own, else its parent's."""
    dcp_dir = Path(dcp_dir)
    return dcp_dir if (dcp_dir / "config.json").is_file() else dcp_dir.parent


def load_dcp(dcp_dir: Path) -> dict:
    """Every entry of a DCP folder as torch's own readers rebuild it: ``dcp_to_torch_save`` into a .pt for
    a FileSystemWriter folder; torch's HuggingFaceStorageReader for the safetensors-backed layout, which
    has no .metadata for dcp_to_torch_save (torch's reader takes each shard's offsets from the headers)."""
    import tempfile

    import torch

    dcp_dir = Path(dcp_dir)
    if (dcp_dir / ".metadata").is_file():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "full.pt"
            dcp_to_torch_save(dcp_dir, target)
            return torch.load(target, weights_only=False)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=HuggingFaceStorageReader(str(dcp_dir)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return sd


def model_entries(state: dict) -> dict:
    """The model's tensors: the "model" entry of get_state_dict's {"model", "optim"}, else the top-level tensors."""
    import torch

    if isinstance(state.get("model"), dict):
        return state["model"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def reference_hf(dcp_dir: Path, out: Path, config: Path | None = None) -> Path:
    """The Hugging Face folder made the way users make one of a DCP checkpoint today: torch's
    ``dcp_to_torch_save``, the model's entries loaded (strictly) into ``AutoModelForCausalLM.from_config``
    of the config beside the checkpoint (or ``config``), and ``save_pretrained(out)``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    state = model_entries(load_dcp(dcp_dir))
    cfg = AutoConfig.from_pretrained(config if config is not None else config_dir(dcp_dir))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out)
    return Path(out)


def summary(made: dict) -> str:
    """One line per launch: name, seconds, folder (for a report)."""
    return "\n".join(f"{n}: {s.seconds:.1f}s {s.dcp}" for n, s in made.items())


if __name__ == "__main__":  # python tests/helpers/dcp_sources.py ROOT: build everything, print the launches
    made = build_all(Path(sys.argv[1]).resolve())
    print(summary(made))
    print(json.dumps({n: str(s.root) for n, s in made.items()}))

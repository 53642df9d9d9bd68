"""TRL's ``SFTTrainer`` fine-tuning a PEFT LoRA model under real DeepSpeed ZeRO-2 and ZeRO-3 on CPU
(tests/workers/trl_client_worker.py, one launch per stage): under ``pyckpt.deepspeed.enable(save="async")`` its
``checkpoint-N/`` folders are stock's, file by file and tensor by tensor, a resume from one reaches stock's
resumed state, and ``pyckpt export`` of one gives the LoRA adapter's fp32 weights, which is all the checkpoint
holds of the model (the Trainer saves a PEFT model's DeepSpeed state without its frozen base weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compare import diff_folders

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[2] / "workers" / "trl_client_worker.py"
SCRIPT = Path(sys.executable).with_name("pyckpt")


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def jobs(request, tmp_path_factory):
    """ROOT holding the worker's four jobs (stock, stock-resume, async, async-resume) at this ZeRO stage, and
    its result.json."""
    root = tmp_path_factory.mktemp(f"trl-zero{request.param}")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(root / "ext"),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(root / "datasets-cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(root), str(root / "tokenizer"), "--stage", str(request.param)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return request.param, root, json.loads((root / "result.json").read_text())


def _differences(stock: Path, mine: Path) -> list:
    """diff_folders (every file: the same bytes, or the same objects tensor by tensor) less the one field that
    differs by design: the output folder the pickled TrainingArguments record (…/stock/run vs …/async/run)."""
    return [d for d in diff_folders(str(stock), str(mine))
            if not (d.startswith(("checkpoint-2/training_args.bin.__dict__['output_dir']:",
                                  "checkpoint-4/training_args.bin.__dict__['output_dir']:"))
                    and str(stock) in d and str(mine) in d)]


def test_the_async_checkpoints_are_stocks(jobs):
    """checkpoint-2/ and checkpoint-4/ of the async run (DeepSpeed's files, the adapter, TRL's model card, the
    Trainer's state and RNG files) are stock's, and so is checkpoint-4/ of the resumed runs; nothing else in the
    run folders (no staging left)."""
    stage, root, result = jobs
    # pyckpt's background write wrote the async runs' checkpoints (SFTTrainer was not left stock), and nothing of
    # the stock runs'
    assert [result[job]["written_in_background"] for job in ("stock", "stock-resume", "async", "async-resume")] \
        == [[], [], ["checkpoint-2", "checkpoint-4"], ["checkpoint-4"]]
    for stock, mine in (("stock", "async"), ("stock-resume", "async-resume")):
        assert _differences(root / stock / "run", root / mine / "run") == []
    run = root / "async" / "run"
    assert sorted(p.name for p in run.iterdir()) == ["README.md", "checkpoint-2", "checkpoint-4"]
    names = {p.name for p in (run / "checkpoint-4").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "latest", "global_step4",
            "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= names
    shards = sorted(p.name for p in (run / "checkpoint-4" / "global_step4").iterdir())
    model_states = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"] \
        if stage == 3 else ["mp_rank_00_model_states.pt"]
    assert shards == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                      "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"] + model_states


def test_a_resume_from_the_async_checkpoint_reaches_stocks_state(jobs):
    """train(resume_from_checkpoint=<run>/checkpoint-2) to step 4: the same losses and the same weights, bit
    for bit, as the resume from stock's checkpoint-2, and as the run that was not interrupted."""
    _, _, result = jobs
    resumed, stock = result["async-resume"], result["stock-resume"]
    assert resumed["global_step"] == stock["global_step"] == 4
    assert resumed["losses"] == stock["losses"] == result["stock"]["losses"]
    assert set(resumed["losses"]) == {"1", "2", "3", "4"}
    assert resumed["weights"] == stock["weights"] == result["stock"]["weights"] == result["async"]["weights"]
    # the LoRA weights moved (lora_B starts at zero), so equal weights say the resume restored them
    trained = torch.load(jobs[1] / "async-resume" / "weights.pt")["trained"]
    assert any("lora_B" in name and trained[name].abs().max() > 0 for name in resumed["trainable"])


def test_pyckpt_export_of_the_async_checkpoint_is_the_lora_adapter_in_fp32(jobs, tmp_path):
    """``pyckpt export checkpoint-4 OUT``: the Trainer saves a PEFT model's DeepSpeed state with
    ``exclude_frozen_parameters=True``, so the checkpoint holds the LoRA weights alone, and the export is
    ``model.safetensors`` with exactly the PeftModel's trainable parameters under its own names
    (``base_model.model.<module>.lora_A.default.weight``: the adapter name kept, the base weights absent, no
    ``config.json`` since the checkpoint has none), in float32 from the optimizer's masters, bit-equal to
    DeepSpeed's ``zero_to_fp32``; cast to bf16 they are the training model's LoRA weights and the
    ``adapter_model.safetensors`` PEFT wrote (its names drop the adapter name), bit for bit; the tokenizer
    files are copied."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    _, root, result = jobs
    checkpoint = root / "async" / "run" / "checkpoint-4"
    out = tmp_path / "export"
    proc = subprocess.run([str(SCRIPT), "export", str(checkpoint), str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    exported = load_file(out / "model.safetensors")
    trainable = result["async"]["trainable"]
    assert sorted(exported) == trainable and len(trainable) == 8  # q_proj and v_proj of two layers, A and B
    assert all(".lora_A.default." in k or ".lora_B.default." in k for k in exported)
    assert all(t.dtype == torch.float32 for t in exported.values())

    reference = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    assert list(reference) == list(exported)
    assert all(torch.equal(reference[k], exported[k]) for k in reference)

    trained = torch.load(root / "async" / "weights.pt")["trained"]  # the module's weights at step 4, bf16
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert sorted(adapter) == sorted(k.replace(".default.", ".") for k in exported)
    for name, tensor in exported.items():
        assert torch.equal(tensor.to(torch.bfloat16), trained[name]), name
        assert torch.equal(tensor.to(torch.bfloat16), adapter[name.replace(".default.", ".")]), name
    assert any("lora_B" in k and exported[k].abs().max() > 0 for k in exported)  # trained away from zero
    # the frozen base weights are in the training model, not in the export (nor in the checkpoint)
    assert set(trained) - set(exported) == {k for k in trained if "lora_" not in k} != set()
    # a PeftModel of the same base and LoRA config takes the export as it is: nothing unexpected, only the base
    # weights missing, the LoRA weights then the export's
    from transformers import AutoTokenizer
    from trl_client_worker import lora_model

    fresh = lora_model(len(AutoTokenizer.from_pretrained(root / "tokenizer")))
    missing, unexpected = fresh.load_state_dict(exported, strict=False)
    assert unexpected == [] and sorted(missing) == sorted(k for k in trained if "lora_" not in k)
    assert all(torch.equal(fresh.state_dict()[k], exported[k]) for k in exported)

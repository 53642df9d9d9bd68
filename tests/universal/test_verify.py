"""python -m pyckpt.verify: real universal folders (pyckpt's and DeepSpeed's own) verify clean, and each
kind of damage is reported naming the file. Damage is done to copies, never to the session fixtures."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import pyckpt
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.universal.verify import VerifyInputError, verify_universal

from conftest import ALL_CONFIGS
from edit import copy_checkpoint, rewrite

# Every stage, bf16, frozen/tied/buffers, BF16_Optimizer, AutoTP, AutoEP (ZeRO-1/2 and ZeRO-3).
DS_CONFIGS = ["s1_fp32_dp2", "s2_bf16_dp2", "s3_fp32_dp2_subgroups", "s3_bf16_dp3", "s1_frozen_tied",
              "s2_bf16_frozen_tied", "s3_frozen_tied", "s1_bf16_dp2_bf16_optimizer", "s3_fp32_dp3_no_uc_info",
              "tp_s1_fp32", "tp_s2_bf16", "tp_s3_fp32", "tp_s3_bf16_kv2", "ep_s1_fp32", "ep_s2_bf16", "ep_s3_fp32",
              "ep_s3_bf16"]


def run(*args):
    # From a neutral folder: in the repository root the source `pyckpt/` (no native module) would
    # shadow the installed package.
    return subprocess.run([sys.executable, "-m", "pyckpt.verify", *map(str, args)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir())


def _problems(report):
    assert not report.ok, report.summary()
    assert report.summary() == f"FAILED: {len(report.problems)} problem{'s' if len(report.problems) > 1 else ''}"
    return [str(p) for p in report.problems]


def _trainable(folder):
    """A parameter folder with the full optimizer state and a 2-d fp32 tensor."""
    zero = folder / "zero"
    for p in sorted(zero.iterdir()):
        if (p / "step.pt").exists() and len(SourceFile(p / "fp32.pt").load()["param"].shape) == 2:
            return p
    raise AssertionError(f"no 2-d trainable parameter in {zero}")


# -- clean outputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_pyckpt_output_verifies(name, pyckpt_universal, checkpoints):
    report = verify_universal(pyckpt_universal[name].parent, against=checkpoints[name].root)
    assert report.ok, report.problems
    assert report.params > 0 and report.files > report.params and report.bytes_checked > 0
    assert report.content_checked > 0 and report.content_skipped == 0
    assert report.summary().startswith(f"OK: {report.params} parameters, {report.files} files, ")


@pytest.mark.parametrize("name", DS_CONFIGS)
def test_deepspeed_output_verifies(name, deepspeed_universal, checkpoints):
    # DeepSpeed's own ds_to_universal output is the reference layout: no check may flag it, alone or
    # against the input it came from (names, shapes and every tensor's CRC agree with pyckpt's plan).
    out = deepspeed_universal[name]
    alone = verify_universal(out)
    assert alone.ok, alone.problems
    against = verify_universal(out, against=checkpoints[name].tag_dir)
    assert against.ok, against.problems
    assert against.params == alone.params and against.content_checked > 0


def test_cli_ok_json(pyckpt_universal, checkpoints):
    out = pyckpt_universal["tp_s2_bf16"]
    proc = run(out, "--against", checkpoints["tp_s2_bf16"].tag_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["problems"] == [] and report["params"] == 24
    assert report["output"] == str(out) and report["summary"].startswith("OK: 24 parameters")
    text = run(out.parent)  # the folder holding latest_universal
    assert text.returncode == 0 and text.stdout.startswith("OK: 24 parameters, ") and "GiB checked" in text.stdout
    assert text.stderr == ""  # no progress bar when stderr is not a terminal


def test_cli_help_and_usage_errors(tmp_path):
    help_text = run("--help").stdout
    for word in ("before deleting", "latest_universal", "CRC-32", "--against", "exp_avg", "param_shapes",
                 "exit status"):
        assert word in help_text, word
    assert run().returncode == 2
    missing = run(tmp_path / "nothing")
    assert missing.returncode == 2 and "not a folder" in missing.stderr and "Traceback" not in missing.stderr
    empty = run(tmp_path)
    assert empty.returncode == 2 and "latest_universal" in empty.stderr


def test_unreadable_against_is_input_error(pyckpt_universal, tmp_path):
    with pytest.raises(VerifyInputError, match="cannot plan"):
        verify_universal(pyckpt_universal["s1_fp32_dp2"], against=tmp_path)
    proc = run(pyckpt_universal["s1_fp32_dp2"], "--against", tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


# -- damage --------------------------------------------------------------------------------------

def test_missing_exp_avg(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s1_fp32_dp2"], tmp_path)
    victim = _trainable(u) / "exp_avg.pt"
    victim.unlink()
    assert _problems(verify_universal(u)) == [f"{victim}: missing, although the other trainable parameters have it"]


def test_truncated_fp32(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s2_bf16_dp2"], tmp_path)
    victim = _trainable(u) / "fp32.pt"
    os.truncate(victim, victim.stat().st_size // 2)
    problems = _problems(verify_universal(u))
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: ")


@pytest.mark.parametrize("member", ["data/0", "data.pkl"])
def test_flipped_byte_fails_crc(member, pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s3_fp32_dp2_subgroups"], tmp_path)
    victim = next(p for p in sorted((u / "zero").iterdir()) if p.is_dir()) / "exp_avg_sq.pt"
    sf = SourceFile(victim)
    off, size, _ = sf.members[f"{sf.prefix}/{member}"]
    at = off + size - 1 if member == "data/0" else off + size // 2
    with open(victim, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x01]))
    problems = _problems(verify_universal(u))
    crc = [p for p in problems if "CRC-32" in p]
    assert len(crc) == 1 and crc[0].startswith(f"{victim}: member {sf.prefix}/{member} fails its CRC-32 check")


def test_shape_changed(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s1_frozen_tied"], tmp_path)
    param = _trainable(u)
    victim = param / "fp32.pt"

    def flatten(obj):
        t = obj["param"]
        t.shape, t.stride = (t.numel(), ), (1, )

    rewrite(victim, flatten)
    problems = _problems(verify_universal(u))
    assert any(p.startswith(f"{param / 'exp_avg.pt'}: shape ") and "differs from fp32.pt's" in p for p in problems)
    assert any(p.startswith(f"{victim}: shape ") and "does not agree with the shape recorded in "
               "mp_rank_00_model_states.pt" in p for p in problems)


def test_shape_changed_in_every_state_of_a_tp_param(pyckpt_universal, tmp_path):
    # Equal shapes across the states are not enough: the full shape must fit the per-tp-rank shapes.
    _, u = copy_checkpoint(pyckpt_universal["tp_s1_fp32"], tmp_path)
    param = u / "zero" / "model.layers.0.mlp.gate_proj.weight"
    for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
        rewrite(param / f, lambda obj: setattr(obj["param"], "shape", (16, 24)))
    problems = _problems(verify_universal(u))
    assert len(problems) == 3 and all("does not agree with the shape recorded" in p for p in problems)


def test_extra_parameter_folder(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s2_bf16_frozen_tied"], tmp_path)
    shutil.copytree(_trainable(u), u / "zero" / "ghost.weight")
    problems = _problems(verify_universal(u))
    assert problems == [f"{u / 'zero' / 'ghost.weight'}: extra parameter: no copied model-state file names it in "
                        "param_shapes or module"]


def test_folder_that_is_not_a_parameter_name(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s1_fp32_dp2"], tmp_path)
    (u / "zero" / "a..b").mkdir()
    assert _problems(verify_universal(u)) == [f"{u / 'zero' / 'a..b'}: folder name has an empty '.'-separated "
                                              "part: not a parameter name"]


@pytest.mark.parametrize("name", ["s1_frozen_tied", "s3_fp32_dp4", "ep_s3_fp32"])
def test_missing_parameter_folder(name, pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal[name], tmp_path)
    victim = sorted(p for p in (u / "zero").iterdir() if p.is_dir())[-1]
    shutil.rmtree(victim)
    problems = _problems(verify_universal(u))
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: missing parameter folder")


@pytest.mark.parametrize("name,victim", [("tp_s1_fp32", "mp_rank_01_model_states.pt"),
                                         ("s3_fp32_dp4", "zero_pp_rank_2_mp_rank_00_model_states.pt"),
                                         ("s2_fp32_dp4", "mp_rank_00_model_states.pt")])
def test_missing_model_states_file(name, victim, pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal[name], tmp_path)
    (u / victim).unlink()
    problems = _problems(verify_universal(u))
    named = str(u) if victim == "mp_rank_00_model_states.pt" else str(u / victim)
    assert any(p.startswith(f"{named}: ") and ("missing" in p or "no *_model_states.pt" in p) for p in problems)


def test_latest_universal_naming_nothing(pyckpt_universal, tmp_path):
    parent, u = copy_checkpoint(pyckpt_universal["s1_fp32_dp2"], tmp_path)
    (parent / "latest_universal").write_text("global_step9_universal")
    proc = run(parent)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{parent / 'latest_universal'}: names 'global_step9_universal', but ")
    assert lines[-1] == "FAILED: 1 problem"
    (parent / "latest_universal").write_text("../elsewhere")
    assert "not a folder name beside it" in _problems(verify_universal(parent))[0]


def test_damage_report_lists_every_problem_and_cli_exits_1(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["ep_s2_bf16"], tmp_path)
    expert = u / "zero" / "model.layers.0.mlp.experts.w1"
    (expert / "step.pt").unlink()
    rewrite(expert / "fp32.pt", lambda obj: obj.pop("ep_num_experts"))
    proc = run(u, "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["summary"] == f"FAILED: {len(report['problems'])} problems"
    paths = {p["path"] for p in report["problems"]}
    assert {str(expert / "step.pt"), str(expert / "fp32.pt")} <= paths
    assert any("ep_num_experts" in p["problem"] for p in report["problems"])


def test_hostile_file_is_reported_not_run(pyckpt_universal, tmp_path):
    _, u = copy_checkpoint(pyckpt_universal["s1_fp32_dp2"], tmp_path)
    victim = _trainable(u) / "exp_avg.pt"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}", ))

    import torch
    torch.save({"param": torch.zeros(1), "x": Payload()}, victim)
    problems = _problems(verify_universal(u))
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: refusing to load global")
    assert not marker.exists()


# -- against the wrong input ---------------------------------------------------------------------

def test_against_other_training_run_differs_in_content(pyckpt_universal, checkpoints):
    # Same model, same names and shapes, other dp degree: only the bytes can tell them apart.
    report = verify_universal(pyckpt_universal["s1_fp32_dp2"], against=checkpoints["s1_fp32_dp4"].root)
    problems = _problems(report)
    assert any(p.startswith(f"{pyckpt_universal['s1_fp32_dp2'] / 'zero' / 'l0.weight' / 'fp32.pt'}: at ['param']: "
                            "tensor bytes differ from the input's (CRC-32 ") for p in problems), problems
    # what else differs: the copied model states and the dp degree in the common optimizer state
    others = [p for p in problems if "tensor bytes differ" not in p]
    assert len(others) == 2 and "of which it should be a copy" in others[0], others
    assert others[1].endswith("optimizer_state.pt: at ['partition_count'][0]: 2, but converting the input gives 4")
    shapes_only = verify_universal(pyckpt_universal["s1_fp32_dp2"], against=checkpoints["s1_fp32_dp4"].root,
                                   content=False)
    assert _problems(shapes_only) == [others[1]]


def test_against_other_model(pyckpt_universal, checkpoints):
    out = pyckpt_universal["s1_fp32_dp2"]
    proc = run(out, "--against", checkpoints["s1_frozen_tied"].tag_dir)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert any(line.startswith(f"{out / 'zero'}/") and "extra parameter: converting" in line for line in lines)
    emb, model = out / "zero" / "emb.weight", out / "mp_rank_00_model_states.pt"
    assert any(line.startswith(f"{emb}: missing parameter folder: converting") for line in lines)
    assert any(line.startswith(f"{model}: is ") and "the copy of" in line for line in lines)
    assert lines[-1].startswith("FAILED: ")


def test_against_planned_file_missing(pyckpt_universal, checkpoints, tmp_path):
    # A model-states file removed: found by the layout check and by the plan.
    _, u = copy_checkpoint(pyckpt_universal["tp_s2_bf16"], tmp_path)
    (u / "mp_rank_01_model_states.pt").unlink()
    problems = _problems(verify_universal(u, against=checkpoints["tp_s2_bf16"].tag_dir))
    assert f"{u / 'mp_rank_01_model_states.pt'}: missing: converting {checkpoints['tp_s2_bf16'].tag_dir} writes it" \
        in problems


def test_lazy_export():
    assert pyckpt.verify_universal is verify_universal and "verify_universal" in dir(pyckpt)


def test_against_missing_parameter_is_one_line_per_source(pyckpt_universal, checkpoints, tmp_path):
    # The layout check and the plan both name the folder; its four state files are not listed again.
    _, u = copy_checkpoint(pyckpt_universal["s2_bf16_dp2"], tmp_path)
    victim = _trainable(u)
    shutil.rmtree(victim)
    problems = _problems(verify_universal(u, against=checkpoints["s2_bf16_dp2"].root))
    assert len(problems) == 2 and all(p.startswith(f"{victim}: missing parameter folder: ") for p in problems)
    assert problems[1].endswith(f"converting {checkpoints['s2_bf16_dp2'].tag_dir} writes it")


def test_corrupt_model_states_is_one_problem(pyckpt_universal, tmp_path):
    # The parameter set comes from this file: its corruption is reported once, not as N extra folders.
    _, u = copy_checkpoint(pyckpt_universal["s2_bf16_frozen_tied"], tmp_path)
    victim = u / "mp_rank_00_model_states.pt"
    os.truncate(victim, 100)
    problems = _problems(verify_universal(u))
    assert len(problems) == 1 and problems[0].startswith(f"{victim}: ")


def test_progress_on_a_terminal(pyckpt_universal, capfd):
    # The byte counter is drawn only on a terminal; elsewhere (here, a pipe) stderr stays clean and
    # the result is the same.
    report = verify_universal(pyckpt_universal["ep_s3_bf16"], progress=True)
    assert report.ok and capfd.readouterr().err == ""
    import pty
    parent, child = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "pyckpt.verify", str(pyckpt_universal["ep_s3_bf16"])],
                              stdout=subprocess.PIPE, stderr=child, text=True, cwd=tempfile.gettempdir())
        os.close(child)
        child = None
        drawn = b""
        while True:
            try:
                chunk = os.read(parent, 65536)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if child is not None:
            os.close(child)
        os.close(parent)
    assert proc.returncode == 0 and proc.stdout.startswith("OK: ")
    assert b"pyckpt verify" in drawn

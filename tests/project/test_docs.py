"""The manual cannot rot: the site builds without a warning, and the code blocks of README.md and docs/*.md run.

Every fenced block carries a language. ``bash`` and ``console`` blocks run through bash, ``python`` blocks
through this interpreter; ``text`` blocks (what a command prints, a diagram) are shown only. A page's blocks
run in order in one working folder of its own, which holds ``ckpt/``: a real DeepSpeed ZeRO-2 checkpoint of
the built-in example's small Llama (pyckpt/demo.py trains it on 2 CPU ranks and saves it through
``pyckpt.deepspeed.save_checkpoint``: DeepSpeed's files, tokenizer, config, training state), its tag renamed
``global_step100`` so that the pages can name it. A python block of the training-job API preceded by
``<!-- with an engine: ... -->`` runs inside one rank of a DeepSpeed job that trains the example's model
(``engine``, ``model``, ``tokenizer``, ``step`` defined). A block that cannot run here is preceded by a marker
``<!-- not run: REASON -->``; those are counted and kept few.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dsharness

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash", "console", "python"}
SHOWN = {"text"}
MARKER = re.compile(r"<!--\s*not run\b(.*?)-->", re.S)
# A python block of the training-job API preceded by this marker runs after ENGINE, which gives it what a
# training script has at that point: one rank of DeepSpeed (gloo, CPU) training the example's model.
WITH_ENGINE = re.compile(r"<!--\s*with an engine\b(.*?)-->", re.S)
ENGINE = """\
import os, socket

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                  WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
import deepspeed
import deepspeed.ops
from deepspeed.ops.op_builder.all_ops import ALL_OPS
from transformers import PreTrainedTokenizerFast

import pyckpt.deepspeed
from pyckpt import demo

# as the example does: no JIT build of DeepSpeed's CPU ops, which only inference needs
deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
tokenizer = PreTrainedTokenizerFast.from_pretrained("ckpt/global_step100")
model = demo._model(len(tokenizer))
engine = demo._engine(model, 2)
step = engine.global_steps
"""
# the end of a rank's script: saves joined, the engine let go, the group left without interpreter shutdown
ENGINE_END = """
pyckpt.deepspeed.wait_for_saves()
engine.destroy()
from pyckpt.execution.distributed import leave_and_exit
leave_and_exit(0)
"""
# Blocks that re-run the set-up, launch several nodes or need a training job's engine: a bound that a new
# page has to argue with rather than slide past.
MAX_NOT_RUN = 10
TAG = "global_step100"


def blocks(page: Path) -> list[dict]:
    """The fenced blocks of ``page``: language, code, line number, and the not-run reason (None: it runs)."""
    out = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).strip(), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        assert end is not None, f"{page.name}:{start + 1}: a fence that is never closed"
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        out.append({"page": page.name, "line": start + 1, "lang": lang, "code": "\n".join(lines[start + 1:end]) + "\n",
                    "not_run": marker.group(1).strip(" :") if marker else None,
                    "engine": bool(WITH_ENGINE.search(before))})
        i = end + 1
    return out


def all_blocks() -> list[dict]:
    return [b for page in PAGES for b in blocks(page)]


def test_the_site_builds_strictly(tmp_path):
    # --strict turns every warning into a failure: a broken link or anchor, a page left out of the nav
    # (mkdocs.yml raises those checks to warnings).
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_block_says_what_it_is_and_every_skip_says_why():
    found = all_blocks()
    assert found, "no code blocks found"
    for b in found:
        where = f"{b['page']}:{b['line']}"
        assert b["lang"] in RUN | SHOWN, f"{where}: fence language {b['lang']!r} (one of {sorted(RUN | SHOWN)})"
        if b["not_run"] is not None:
            assert b["lang"] in RUN, f"{where}: a not-run marker before a block that never runs"
            assert len(b["not_run"]) >= 10, f"{where}: a not-run marker needs its reason"
        if b["engine"]:
            assert b["lang"] == "python", f"{where}: only a python block can be given an engine"
    skipped = [b for b in found if b["not_run"] is not None]
    assert len(skipped) <= MAX_NOT_RUN, [f"{b['page']}:{b['line']}: {b['not_run']}" for b in skipped]
    # each marker belongs to a block: one left behind above prose would silently mark nothing
    markers = sum(len(MARKER.findall(page.read_text())) for page in PAGES)
    assert markers == len(skipped)
    assert sum(len(WITH_ENGINE.findall(page.read_text())) for page in PAGES) == sum(b["engine"] for b in found)


def test_the_readme_is_a_five_minute_read():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    # it starts with the two commands that work on a fresh machine
    first = next(b for b in blocks(ROOT / "README.md"))
    assert "bash scripts/demo.sh" in first["code"] and "bash scripts/test.sh" in first["code"]


def support_table(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- support table")) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_the_readme_and_the_convert_page_show_one_support_table():
    readme = support_table(ROOT / "README.md")
    assert len(readme) > 3 and readme == support_table(ROOT / "docs" / "convert.md")


@pytest.fixture(scope="module")
def example_checkpoint(tmp_path_factory) -> Path:
    """The built-in example's training run alone (pyckpt/demo.py: tokenizer, 2 ranks, the save through
    pyckpt's save glue), its tag renamed so the pages can name it."""
    work = tmp_path_factory.mktemp("docs-example")
    env = dsharness.ds_env(work)
    train = ("import os, sys\n"
             "from pyckpt import demo\n"
             "work = sys.argv[1]\n"
             "os.makedirs(os.path.join(work, 'logs'))\n"
             "demo.build_tokenizer(os.path.join(work, 'tokenizer'))\n"
             "demo._spawn(demo._train, demo.TRAIN_RANKS, work, demo._free_port(), 2)\n")
    # cwd outside the source folder: there `import pyckpt` would find the sources without their native module
    proc = subprocess.run([sys.executable, "-c", train, str(work)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=str(work))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = work / "ckpt"
    (work / "checkpoint").rename(ckpt)
    saved = (ckpt / "latest").read_text().strip()
    (ckpt / saved).rename(ckpt / TAG)
    (ckpt / "latest").write_text(TAG)
    state = ckpt / TAG / "training_state.json"
    state.write_text(state.read_text().replace(f'"{saved}"', f'"{TAG}"'))
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("page", [p.name for p in PAGES
                                  if any(b["lang"] in RUN and b["not_run"] is None for b in blocks(p))])
def test_the_code_blocks_of_a_page_run(page, example_checkpoint, tmp_path):
    path = next(p for p in PAGES if p.name == page)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(example_checkpoint, work / "ckpt", symlinks=True)
    env = dsharness.ds_env(tmp_path)
    # the commands as a user's shell finds them: this environment's pyckpt, torchrun and python first
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    ran = 0
    for b in blocks(path):
        if b["lang"] not in RUN or b["not_run"] is not None:
            continue
        code = b["code"]
        if b["lang"] == "console":
            code = "".join(line[2:] + "\n" for line in code.splitlines() if line.startswith("$ "))
        if b["lang"] == "python":
            script = tmp_path / "block.py"
            script.write_text(ENGINE + code + ENGINE_END if b["engine"] else code)
            cmd = [sys.executable, str(script)]
        else:
            script = tmp_path / "block.sh"
            script.write_text("set -euo pipefail\n" + code)
            cmd = ["bash", str(script)]
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{page}:{b['line']} ({b['lang']}) exited {proc.returncode}:\n{code}\n" \
                                     f"{proc.stdout[-4000:]}"
        ran += 1
    assert ran

"""benchmarks/plot_figures.py on the committed results: every figure is well-formed SVG with the series a
reader expects, one mark per category in each, the numbers on the marks the JSON's, and its results
file named. Fast: no benchmark runs, only the script over benchmarks/results/."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "plot_figures.py"
RESULTS = ROOT / "benchmarks" / "results"
SVG = "{http://www.w3.org/2000/svg}"

MEMORY = ["pyckpt memory tier, sync", "pyckpt memory tier, async", "DLRover Flash Checkpoint, MEMORY"]
EXPECTED = {
    "convert_vs_size": ["pyckpt convert", "ds_to_universal.py", "cp -r of the input"],
    "save_stall": ["DeepSpeed's save_checkpoint (the whole save)", "pyckpt save_checkpoint(async_save=True)",
                   "plain copy of the snapshot's bytes (floor)"],
    "memory_vs_dlrover_stall": MEMORY + ["DeepSpeed save to disk"],
    "recovery_load": MEMORY + ["DeepSpeed load, page cache", "DeepSpeed load, evicted from the page cache"],
    "load_into_deepspeed": ["DeepSpeed's universal load", "the same under pyckpt.deepspeed.enable()",
                            "pyckpt direct resume from the ZeRO shards", "ds_to_universal.py + DeepSpeed's load"],
}


def memory_runs() -> list:
    """The memory_vs_dlrover results files in the order the figures draw them: the order they were run,
    a session's number read as a number (_s9 before _s10)."""
    def key(path: Path):
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]

    return sorted(RESULTS.glob("memory_vs_dlrover_*.json"), key=key)


def test_the_memory_runs_are_drawn_in_the_order_they_were_run():
    names = [p.name for p in memory_runs()]
    assert names.index("memory_vs_dlrover_z2_100M_dp2_s9.json") < names.index("memory_vs_dlrover_z2_100M_dp2_s10.json")
    assert names.index("memory_vs_dlrover_z2_100M_dp2_s3.json") < names.index("memory_vs_dlrover_z2_100M_dp2_s10.json")


def run(out: Path, results: Path = RESULTS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("figures")
    proc = run(out)
    assert proc.returncode == 0, proc.stderr
    return out


def series(svg: ET.Element) -> dict:
    """name -> the value labels on its marks ("n/a" where a category has none)."""
    found = {}
    for g in svg.iter(f"{SVG}g"):
        if g.get("class") == "series":
            found[g.get("data-name")] = [t.text for t in g.iter(f"{SVG}text")]
    return found


def marks(g_name: str, svg: ET.Element) -> int:
    g = next(g for g in svg.iter(f"{SVG}g") if g.get("data-name") == g_name)
    return len(g.findall(f"{SVG}rect")) + len(g.findall(f"{SVG}circle"))


def test_every_figure_parses_and_has_its_series(drawn):
    assert sorted(p.stem for p in drawn.glob("*.svg")) == sorted(EXPECTED)
    run_files = [p.name for p in memory_runs()]
    for name, expected in EXPECTED.items():
        svg = ET.parse(drawn / f"{name}.svg").getroot()
        assert svg.tag == f"{SVG}svg", name
        assert list(series(svg)) == expected, name
        title = svg.find(f"{SVG}title")
        assert title is not None and title.text, name
        text = " ".join(t.text or "" for t in svg.iter(f"{SVG}text"))
        assert "Source (benchmarks/results/):" in text, name
        if name in ("memory_vs_dlrover_stall", "recovery_load"):  # one group per run, each named
            for run_file in run_files:
                assert run_file in text and run_file[:-len(".json")] in text, (name, run_file)
        # one mark (bar or point) or an "n/a" for every category, in every series
        for label, values in series(svg).items():
            assert marks(label, svg) + values.count("n/a") == len(values), (name, label)


def test_the_numbers_are_the_jsons(drawn):
    data = json.loads((RESULTS / "async_save_z2_200M_dp4.json").read_text())["async"]["rounds"]
    stall = series(ET.parse(drawn / "save_stall.svg").getroot())
    assert stall["DeepSpeed's save_checkpoint (the whole save)"] == [f"{r['sync_stall']:.2f}" for r in data]
    assert stall["pyckpt save_checkpoint(async_save=True)"] == [f"{r['async_stall']:.2f}" for r in data]

    sizes = json.loads((RESULTS / "scaling_size.json").read_text())["points"]
    convert = series(ET.parse(drawn / "convert_vs_size.svg").getroot())
    assert convert["ds_to_universal.py"] == [f"{p['tools']['ds_to_universal']['median_s']:.2f}" for p in sizes.values()]

    runs = [json.loads(p.read_text()) for p in memory_runs()]
    memory = series(ET.parse(drawn / "memory_vs_dlrover_stall.svg").getroot())
    assert memory["DLRover Flash Checkpoint, MEMORY"] == [f"{r['medians']['dlrover']['stall']:.3f}" for r in runs]
    restart = series(ET.parse(drawn / "recovery_load.svg").getroot())
    assert restart["pyckpt memory tier, sync"] == [f"{r['medians']['pyckpt_sync']['restart_load']:.2f}" for r in runs]

    # load.py records every rank: a round's time is its slowest rank's, the bar the median of the rounds
    per_rank = json.loads((RESULTS / "load_z3_200M_dp4.json").read_text())["rounds"]
    slowest = [max(rank[i]["direct"]["seconds"] for rank in per_rank) for i in range(len(per_rank[0]))]
    load = series(ET.parse(drawn / "load_into_deepspeed.svg").getroot())
    assert load["pyckpt direct resume from the ZeRO shards"][2] == f"{statistics.median(slowest):.2f}"


def test_the_output_depends_only_on_the_results(drawn, tmp_path):
    again = tmp_path / "again"
    assert run(again).returncode == 0
    for svg in drawn.glob("*.svg"):
        assert (again / svg.name).read_bytes() == svg.read_bytes(), svg.name


def test_a_missing_results_file_is_one_line_naming_it(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "scaling_size.json", results)
    proc = run(tmp_path / "out", results)
    assert proc.returncode != 0
    line = proc.stderr.strip()
    assert "\n" not in line and "async_save_z2_200M_dp4.json" in line, proc.stderr

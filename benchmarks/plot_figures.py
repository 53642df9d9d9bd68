"""The few figures a reader compares, drawn as SVG from the results JSON in benchmarks/results/.

    python benchmarks/plot_figures.py                      # writes docs/figures/*.svg
    python benchmarks/plot_figures.py --out /tmp/figures   # anywhere else

No plotting library: each figure is a small SVG written here (the project adds no dependency for its
pictures). Every figure names the results file(s) it is drawn from, its units and what kind of number
it is (a median of rounds, a single measurement); the numbers are the JSON's, unrounded until printed
on the bar. The output depends only on the JSON, so a rerun on unchanged results writes the same bytes.

Figures (FIGURES below): the Universal conversion against ds_to_universal and cp -r across model sizes;
the stall of a save (the asynchronous save against DeepSpeed's, and the memory tier against DLRover's
Flash Checkpoint and DeepSpeed's disk save, one group per memory_vs_dlrover_*.json); the load after a
SIGKILL and restart from those same runs; the load into a running DeepSpeed job.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE.parent / "docs" / "figures"

WIDTH, PLOT_HEIGHT = 820, 280
LEFT, RIGHT = 72, 24
FONT = "font-family=\"DejaVu Sans, Arial, sans-serif\""
# Okabe-Ito, told apart by readers with the common colour-vision deficiencies; one colour per tool in
# every figure: pyckpt blue (its second way sky blue), DeepSpeed vermilion (its second way orange),
# DLRover green, a plain copy grey, DeepSpeed's converter followed by its load purple
PYCKPT, PYCKPT_2, DEEPSPEED, DEEPSPEED_2 = "#0072B2", "#56B4E9", "#D55E00", "#E69F00"
DLROVER, COPY, CONVERT = "#009E73", "#999999", "#CC79A7"


class Series:
    """One named row of values, one per category (None: not measured there, drawn as "n/a")."""

    def __init__(self, name: str, values: Sequence[Optional[float]], colour: str):
        self.name = name
        self.values = list(values)
        self.colour = colour


class Figure:
    """What a chart shows: its file name, title, notes under the title (what the numbers are), the
    categories along x, the series, the y axis' label, and the results files it was drawn from."""

    def __init__(self, name: str, title: str, notes: List[str], categories: List[str], series: List[Series],
                 y_label: str, sources: List[str], log_y: bool = False, value_format: str = "{:.2f}"):
        self.name, self.title, self.notes = name, title, notes
        self.categories, self.series = categories, series
        self.y_label, self.sources, self.log_y, self.value_format = y_label, sources, log_y, value_format


# ---------------------------------------------------------------------------------------------- reading

def _load(results: Path, name: str) -> dict:
    path = results / name
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"plot_figures: {path}: cannot read a results file ({exc})")


def _dtype(data: dict) -> str:
    return f" {data['dtype']}" if data.get("dtype") else ""


def _slowest_median(per_rank: list, way: str) -> Tuple[float, int]:
    """load.py's rounds are per rank; a round's time is its slowest rank's, the figure their median."""
    rounds = len(per_rank[0])
    times = [max(rank[i][way]["seconds"] for rank in per_rank) for i in range(rounds)]
    return statistics.median(times), rounds


def convert_vs_size(results: Path) -> Figure:
    src = "scaling_size.json"
    data = _load(results, src)
    points = data["points"]
    sizes = list(points)
    tools = [("pyckpt", "pyckpt convert", PYCKPT), ("ds_to_universal", "ds_to_universal.py", DEEPSPEED),
             ("cp -r", "cp -r of the input", COPY)]
    series = [Series(label, [points[s]["tools"][key]["median_s"] for s in sizes], colour)
              for key, label, colour in tools]
    categories = [f"{s} ({points[s]['input_bytes'] / 2**30:.2f} GiB)" for s in sizes]
    rounds = sorted({points[s]["runs"] for s in sizes})
    unchecked = [s for s in sizes if not points[s].get("checked_bit_equal")]
    ratio = ", ".join(f"{s} {points[s]['ratios']['ds_to_universal / pyckpt']['median']:.1f}x" for s in sizes)
    notes = [f"{data['title']}.",
             f"One run; each point the median of {'-'.join(map(str, rounds))} alternating rounds"
             + (f" ({', '.join(unchecked)}: outputs not compared bit for bit)" if unchecked else "") + ".",
             f"ds_to_universal / pyckpt, median of per-round ratios: {ratio}."]
    return Figure("convert_vs_size", "Universal conversion: pyckpt vs ds_to_universal vs cp -r, by model size", notes,
                  categories, series, "seconds (log scale)", [src], log_y=True)


def save_stall(results: Path) -> Figure:
    src = "async_save_z2_200M_dp4.json"
    data = _load(results, src)
    rounds = data["async"]["rounds"]
    categories = [f"round {r['round']}" for r in rounds]
    series = [Series("DeepSpeed's save_checkpoint (the whole save)", [r["sync_stall"] for r in rounds], DEEPSPEED),
              Series("pyckpt save_checkpoint(async_save=True)", [r["async_stall"] for r in rounds], PYCKPT),
              Series("plain copy of the snapshot's bytes (floor)", [r["memcpy"] for r in rounds], COPY)]
    med = data["async"]["medians"]
    notes = [f"{data['params'] / 1e6:.0f}M parameters, ZeRO-{data['stage']}{_dtype(data)}, {data['world_size']} ranks, "
             f"{data['cores']} CPU cores; the slowest rank's seconds in the call.",
             f"One run of {len(rounds)} rounds, order alternating. Median stall ratio DeepSpeed / pyckpt async: "
             f"{med['sync_over_async_stall']:.1f}x; pyckpt / plain copy: {med['async_stall_over_memcpy']:.2f}x."]
    return Figure("save_stall", "Stall per save: asynchronous save vs DeepSpeed's save", notes, categories, series,
                  "seconds training waits per save", [src])


MEMORY_WAYS = [("pyckpt_sync", "pyckpt memory tier, sync", PYCKPT),
               ("pyckpt_async", "pyckpt memory tier, async", PYCKPT_2),
               ("dlrover", "DLRover Flash Checkpoint, MEMORY", DLROVER),
               ("deepspeed", "DeepSpeed save to disk", DEEPSPEED)]


def _memory_runs(results: Path) -> List[Tuple[str, dict]]:
    # in the order they were run: _s10 after _s9, not after _rerun
    found = sorted((p.name for p in results.glob("memory_vs_dlrover_*.json")),
                   key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
    if not found:
        raise SystemExit(f"plot_figures: {results}: no memory_vs_dlrover_*.json to draw")
    return [(name, _load(results, name)) for name in found]


def _run_label(name: str, data: dict) -> str:
    rounds = len({row["round"] for row in data.get("rows", [])})
    return f"{name[:-len('.json')]}\n({data.get('date', 'no date')}, {rounds} round{'s' if rounds != 1 else ''})"


def _median(data: dict, way: str, key: str) -> Optional[float]:
    value = data["medians"].get(way, {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def memory_stall(results: Path) -> Figure:
    runs = _memory_runs(results)
    categories = [_run_label(name, data) for name, data in runs]
    series = [Series(label, [_median(data, way, "stall") for _, data in runs], colour)
              for way, label, colour in MEMORY_WAYS]
    first = runs[0][1]
    stage = re.search(r"_z(\d)_", runs[0][0])
    notes = [f"{first.get('params_arg', '?')} parameters (width {first.get('width', '?')})"
             f"{', ZeRO-' + stage.group(1) if stage else ''}{_dtype(first)}, "
             f"{first.get('nproc', '?')} ranks, {first.get('cores', '?')} CPU cores.",
             f"Each group is one run; a bar is the median over its rounds of the median of {first.get('steps', '?')} "
             "steps' save calls,",
             "slowest rank. Runs on a shared machine: compare bars within a group, not across groups."]
    return Figure("memory_vs_dlrover_stall", "Stall per save: memory tier vs DLRover vs DeepSpeed's disk save", notes,
                  categories, series, "seconds training waits per save", [name for name, _ in runs],
                  value_format="{:.3f}")


def recovery_load(results: Path) -> Figure:
    runs = _memory_runs(results)
    ways = MEMORY_WAYS[:3] + [("deepspeed", "DeepSpeed load, page cache", DEEPSPEED),
                              ("deepspeed_evicted", "DeepSpeed load, evicted from the page cache", DEEPSPEED_2)]
    categories = [_run_label(name, data) for name, data in runs]
    series = [Series(label, [_median(data, way, "restart_load") for _, data in runs], colour)
              for way, label, colour in ways]
    whole = [v for _, data in runs for way, _, _ in ways if (v := _median(data, way, "kill_to_first_step")) is not None]
    notes = ["The load phase of a restart after SIGKILL of every worker (engine.load_checkpoint or DLRover's load,",
             "to its return), slowest rank. One restart per way and run: single measurements, not medians.",
             f"The whole restart (kill to the end of the first step) took {min(whole):.0f}-{max(whole):.0f} s, "
             "mostly start-up that every way pays."]
    return Figure("recovery_load", "Recovery: the load after a SIGKILL and restart", notes, categories, series,
                  "seconds", [name for name, _ in runs])


def load_into_deepspeed(results: Path) -> Figure:
    files = ["load_z2_200M_dp4.json", "load_z2_bf16_200M_dp4.json", "load_z3_200M_dp4.json"]
    ways = [("stock", "DeepSpeed's universal load", DEEPSPEED),
            ("pyckpt", "the same under pyckpt.deepspeed.enable()", PYCKPT),
            ("direct", "pyckpt direct resume from the ZeRO shards", PYCKPT_2),
            ("convert+stock", "ds_to_universal.py + DeepSpeed's load", CONVERT)]
    runs = [(name, _load(results, name)) for name in files]
    categories, values, counts = [], {way: [] for way, _, _ in ways}, set()
    for name, data in runs:
        categories.append(f"ZeRO-{data['stage']}, {data['dtype']}")
        for way, _, _ in ways:
            median, rounds = _slowest_median(data["rounds"], way)
            values[way].append(median)
            counts.add(rounds)
    first = runs[0][1]
    warmups = sorted({data.get("warmup", 0) for _, data in runs})
    notes = [f"A {first['params']}-parameter model, {first['world_size']} ranks; the slowest rank's seconds from a "
             "barrier to the load's return.",
             f"One run of {'-'.join(map(str, sorted(counts)))} rotating rounds per group; a bar is the median of "
             "the rounds" + (f", after {'-'.join(map(str, warmups))} untimed warm-up load(s) of each way."
                             if warmups != [0] else ".")]
    return Figure("load_into_deepspeed", "Loading into a running DeepSpeed job", notes, categories,
                  [Series(label, values[way], colour) for way, label, colour in ways], "seconds", files)


FIGURES: List[Callable[[Path], Figure]] = [convert_vs_size, save_stall, memory_stall, recovery_load, load_into_deepspeed]


# ---------------------------------------------------------------------------------------------- drawing

def _num(x: float) -> str:
    """Coordinates with one decimal: enough for the eye, and the same bytes on every platform."""
    return f"{x:.1f}"


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{_num(x)}" y="{_num(y)}" font-size="{size}" text-anchor="{anchor}" {FONT}{extra}>'
            f"{escape(s)}</text>")


def _nice_max(top: float) -> Tuple[float, float]:
    """An axis end at or above ``top`` and its tick step (1, 2 or 5 times a power of ten, 4-8 ticks)."""
    if top <= 0:
        return 1.0, 0.25
    magnitude = 10 ** math.floor(math.log10(top))
    for step in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10):
        s = step * magnitude
        if math.ceil(top / s) <= 8:
            return math.ceil(top / s) * s, s
    return top, top / 4


def _format_tick(v: float) -> str:
    return f"{v:g}"


def _wrap(items: List[str], prefix: str, width: int) -> List[str]:
    """``prefix`` and the comma-separated ``items`` in lines of at most ``width`` characters."""
    lines, line = [], prefix
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(line) + 1 + len(piece) > width and line.strip():
            lines.append(line)
            line = "  " + piece
        else:
            line = f"{line} {piece}" if line else piece
    return lines + [line]


def render(fig: Figure) -> str:
    n_cat, n_ser = len(fig.categories), len(fig.series)
    cat_lines = max(len(c.split("\n")) for c in fig.categories)
    legend_rows = (n_ser + 1) // 2
    source = _wrap(list(fig.sources), "Source (benchmarks/results/):", 120)
    top = 58 + 15 * len(fig.notes)
    bottom = 12 + 14 * cat_lines + 8 + 16 * legend_rows + 8 + 13 * len(source)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, PLOT_HEIGHT
    height = top + plot_h + bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" role="img">',
           f"<title>{escape(fig.title)}</title>",
           f"<desc>{escape(' '.join(fig.notes))} {escape(' '.join(source))}</desc>",
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           _text(LEFT, 24, fig.title, 16, extra=' font-weight="bold"')]
    for i, line in enumerate(fig.notes):
        out.append(_text(LEFT, 44 + 15 * i, line, 11, extra=' fill="#333"'))
    values = [v for s in fig.series for v in s.values if v is not None]
    if fig.log_y:
        lo = 10 ** math.floor(math.log10(min(values)))
        hi = 10 ** math.ceil(math.log10(max(values)))

        def y_of(v: float) -> float:
            return top + plot_h * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))

        ticks = [lo * 10 ** k for k in range(round(math.log10(hi / lo)) + 1)]
    else:
        hi, step = _nice_max(max(values) * 1.12)

        def y_of(v: float) -> float:
            return top + plot_h * (1 - v / hi)

        ticks = [step * k for k in range(round(hi / step) + 1)]
    base = top + plot_h
    for t in ticks:
        y = y_of(t)
        out.append(f'<line x1="{LEFT}" y1="{_num(y)}" x2="{LEFT + plot_w}" y2="{_num(y)}" stroke="#ddd"/>')
        out.append(_text(LEFT - 6, y + 4, _format_tick(t), 11, "end"))
    out.append(f'<line x1="{LEFT}" y1="{top}" x2="{LEFT}" y2="{base}" stroke="#333"/>')
    out.append(f'<line x1="{LEFT}" y1="{base}" x2="{LEFT + plot_w}" y2="{base}" stroke="#333"/>')
    cy = top + plot_h / 2
    out.append(_text(18, cy, fig.y_label, 12, "middle", f' transform="rotate(-90 18 {_num(cy)})"'))
    group_w = plot_w / n_cat
    for i, cat in enumerate(fig.categories):
        for j, part in enumerate(cat.split("\n")):
            out.append(_text(LEFT + group_w * (i + 0.5), base + 16 + 14 * j, part, 11 if j == 0 else 10, "middle"))
    for k, s in enumerate(fig.series):
        out.append(f'<g class="series" data-name="{escape(s.name, {chr(34): "&quot;"})}" fill="{s.colour}">')
        if fig.log_y:  # a line through the categories, each point labelled (the first series below its line,
            # the others above, so that two series close together keep their labels apart)
            shown = [(i, v) for i, v in enumerate(s.values) if v is not None]
            pts = [(LEFT + group_w * (i + 0.5), y_of(v)) for i, v in shown]
            out.append(f'<polyline fill="none" stroke="{s.colour}" stroke-width="2" '
                       f'points="{" ".join(_num(x) + "," + _num(y) for x, y in pts)}"/>')
            for (x, y), (_, v) in zip(pts, shown):
                out.append(f'<circle cx="{_num(x)}" cy="{_num(y)}" r="4"/>')
                out.append(_text(x + 7, y + 15 if k == 0 else y - 6, fig.value_format.format(v), 10))
        else:  # bars side by side in each category, each labelled with its value
            bar_w = group_w * 0.8 / n_ser
            for i, v in enumerate(s.values):
                x = LEFT + group_w * i + group_w * 0.1 + bar_w * k
                if v is None:
                    out.append(_text(x + bar_w / 2, base - 4, "n/a", 9, "middle", ' fill="#666"'))
                    continue
                y = y_of(v)
                out.append(f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(bar_w - 1)}" height="{_num(base - y)}"/>')
                out.append(_text(x + bar_w / 2, y - 3, fig.value_format.format(v), 9, "middle", ' fill="#000"'))
        out.append("</g>")
    ly = base + 12 + 14 * cat_lines + 8
    for k, s in enumerate(fig.series):
        x, y = LEFT + (k % 2) * (plot_w / 2), ly + (k // 2) * 16
        out.append(f'<rect x="{_num(x)}" y="{_num(y - 9)}" width="12" height="10" fill="{s.colour}"/>')
        out.append(_text(x + 17, y, s.name, 11))
    sy = ly + 16 * legend_rows + 8
    for j, line in enumerate(source):
        out.append(_text(LEFT, sy + 13 * j, line, 10, extra=' fill="#555"'))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        description="Draw the benchmark figures a reader compares as SVG, from the results JSON. "
                    "Regenerate the committed ones with `python benchmarks/plot_figures.py` (writes docs/figures/*.svg) "
                    "after a results file they draw from changes.")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default: benchmarks/results)")
    p.add_argument("--out", type=Path, default=OUT, help="where the .svg files go (default: docs/figures)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for make in FIGURES:
        fig = make(args.results)
        path = args.out / f"{fig.name}.svg"
        path.write_text(render(fig))
        print(f"{path}  ({', '.join(fig.sources)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes each rank reads to resume from a Universal Checkpoint: DeepSpeed 0.19.8's loader vs pyckpt's.

    python benchmarks/cost_model.py            # the Markdown table in benchmarks/README.md

The model, from what DeepSpeed's load path reads (deepspeed/checkpoint/universal_checkpoint.py,
deepspeed/runtime/zero/stage3.py, deepspeed/runtime/state_dict_factory.py), for a dense model of P
parameters trained in bf16 with Adam on N data-parallel ranks (no tensor parallelism):

- every universal state file is fp32: fp32 + exp_avg + exp_avg_sq = 12 bytes per parameter;
- DeepSpeed, ZeRO-1/2: each rank torch.loads the whole files of every parameter its partition
  touches, 12·P/N plus up to two straddling parameters (24·F_max, F_max the largest parameter),
  and the model-state file twice (its bf16 ``module``: 2·2·P);
- DeepSpeed, ZeRO-3: every rank loads every parameter's three files, 12·P;
- pyckpt: each rank gathers its own elements only, 12·P/N, and maps the model-state file without
  reading ``module``; resuming straight from the ZeRO shards reads the same bytes.

The measured counterpart at 200M parameters on 4 ranks is benchmarks/load.py.
"""

MODELS = {  # parameters, largest parameter (Llama-2 shapes: the 32000-row embedding)
    "7B": (6.74e9, 32000 * 4096),
    "70B": (68.98e9, 32000 * 8192),
}
RANKS = (8, 128, 1024)


def per_rank(p: float, f_max: float, n: int):
    zero12 = 12 * p / n + 24 * f_max + 4 * p
    zero3 = 12 * p
    own = 12 * p / n
    return zero12, zero3, own


def fmt(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def table() -> str:
    lines = ["| model | ranks | DeepSpeed ZeRO-1/2, per rank | DeepSpeed ZeRO-3, per rank | pyckpt, per rank "
             "| DeepSpeed ZeRO-3, all ranks | pyckpt, all ranks |",
             "|---|---|---|---|---|---|---|"]
    for name, (p, f_max) in MODELS.items():
        for n in RANKS:
            z12, z3, own = per_rank(p, f_max, n)
            lines.append(f"| {name} | {n} | {fmt(z12)} | {fmt(z3)} | {fmt(own)} | {fmt(z3 * n)} | {fmt(own * n)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())

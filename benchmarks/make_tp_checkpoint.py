"""A Megatron-style tensor-parallel ZeRO-2 checkpoint in DeepSpeed's format, for the TP benchmark.

    python benchmarks/make_tp_checkpoint.py OUT --tp 4 --dp 4 --hidden 1024 --layers 16

Each layer has a column-parallel QKV and h->4h (split on dim 0), row-parallel attention output and
4h->h (split on dim 1: the strided merge), and a replicated layernorm; a vocabulary-padded embedding
heads the stack. It is written by tests/helpers/tp_builder.py, the same code whose small checkpoints
tests/zero/test_megatron_tp_pp.py proves format-exact against DeepSpeed's ds_to_universal.
"""

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))

from tp_builder import Param, build, replicate, split_dim  # noqa: E402


def params(hidden: int, layers: int, vocab: int):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    out = [Param("embed.weight", rand(vocab, hidden), split_dim(0))]
    for i in range(layers):
        out += [
            Param(f"layers.{i}.norm.weight", rand(hidden), replicate),
            Param(f"layers.{i}.qkv.weight", rand(3 * hidden, hidden), split_dim(0)),
            Param(f"layers.{i}.dense.weight", rand(hidden, hidden), split_dim(1)),
            Param(f"layers.{i}.h_to_4h.weight", rand(4 * hidden, hidden), split_dim(0)),
            Param(f"layers.{i}.four_h_to_h.weight", rand(hidden, 4 * hidden), split_dim(1)),
        ]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32004, help="padded vocabulary rows (divisible by --tp)")
    args = p.parse_args(argv)
    info = {
        "universal_checkpoint_version": 0.4,
        "tp_replicated_parameter_patterns": [r"layers\.\d+\.norm\.weight"],
        "parameter_with_row_parallelism_patterns": [r"layers\.\d+\.dense\.weight", r"layers\.\d+\.four_h_to_h\.weight"],
        "vocabulary_parameter_patterns": [r"embed\.weight"],
        "original_vocab_size": args.vocab - 3,
    }
    t0 = time.perf_counter()
    prm = params(args.hidden, args.layers, args.vocab)
    folder = build(args.out, prm, info, args.tp, 1, args.dp, stage=2, tag="global_step1")
    n = sum(x.full.numel() for x in prm)
    print(f"{folder}: {n:,} params, tp={args.tp} x dp={args.dp}, ZeRO-2 fp32, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

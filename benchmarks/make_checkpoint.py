"""``python benchmarks/make_checkpoint.py OUT --params 1B --dp 64 --stage 2``: a synthetic DeepSpeed ZeRO
checkpoint of any size in seconds, through pyckpt's writer (:mod:`pyckpt.testing`, which says what it
writes and how).

    python benchmarks/make_checkpoint.py OUT --params 1B --dp 64 --stage 2 [--dtype fp32|bf16]
        [--layers N] [--hidden H] [--experts 64 --ep 8 --moe-layers 2] [--sub-group-size N] [--tp N]
        [--family toy|llama|mixtral|deepseek [--heads N] [--kv-heads N] [--dense-layers N] [--vocab N]]
"""

from __future__ import annotations

import argparse
import sys

from pyckpt.testing import FAMILIES, make_checkpoint

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/make_checkpoint.py",
                                description="Write a synthetic DeepSpeed 0.19.8 ZeRO checkpoint (pp = 1) of any size "
                                "in seconds, through pyckpt's writer. OUT gets `latest` and global_step1/.")
    p.add_argument("out", help="the save dir: gets `latest` and global_step1/")
    p.add_argument("--params", default="1B", help="target parameter count: 1B, 350M, 50k, ... (default 1B)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel degree (number of ZeRO shards)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model dtype (masters stay fp32)")
    p.add_argument("--layers", type=int, help="number of layers (default: from --params)")
    p.add_argument("--hidden", type=int, help="hidden size (default: solved from --params and --layers)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: a Megatron-style model cut into tp slices (column, row, fused, "
                        "vocabulary, replicated and averaged parameters), files per tp rank")
    p.add_argument("--family", choices=FAMILIES, default="toy",
                   help="parameter layout: toy (default: the small synthetic stacks), llama (LlamaForCausalLM names, "
                        "9 per layer + 3; with --tp, as DeepSpeed AutoTP cuts it), mixtral or deepseek (DeepSeek-V3) under AutoEP")
    p.add_argument("--heads", type=int, help="llama/mixtral/deepseek: attention heads (default: from --hidden)")
    p.add_argument("--kv-heads", type=int, help="llama/mixtral: key/value heads (grouped-query; default from --heads)")
    p.add_argument("--dense-layers", type=int, default=3,
                   help="deepseek: the first N layers keep a dense MLP (first_k_dense_replace; default 3)")
    p.add_argument("--vocab", type=int, help="llama/mixtral/deepseek: vocabulary rows (default: the real model's)")
    p.add_argument("--experts", type=int, default=0,
                   help="AutoEP experts per MoE layer (0: dense model; mixtral/deepseek default 8/256)")
    p.add_argument("--ep", type=int, default=1, help="AutoEP size (EP ranks); must divide --dp and --experts")
    p.add_argument("--moe-layers", type=int, default=0, help="number of MoE layers (default 2 with --experts)")
    p.add_argument("--data-before-expert", action="store_true",
                   help="use_data_before_expert_parallelism: EP rank e owns dp ranks [e*dp/ep, (e+1)*dp/ep)")
    p.add_argument("--sub-group-size", type=int, help="ZeRO-3 sub_group_size (elements per rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", "-j", type=int, help="copy threads (default: one per core)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT/global_step1 if it exists")
    args = p.parse_args(argv)
    info: dict = {}
    try:
        tag_dir = make_checkpoint(args.out, params=args.params, dp=args.dp, stage=args.stage, dtype=args.dtype,
                                  layers=args.layers, hidden=args.hidden, experts=args.experts, ep=args.ep,
                                  moe_layers=args.moe_layers, sub_group_size=args.sub_group_size,
                                  data_before_expert=args.data_before_expert, seed=args.seed, workers=args.workers,
                                  overwrite=args.overwrite, report=info, tp=args.tp, family=args.family,
                                  heads=args.heads, kv_heads=args.kv_heads, dense_layers=args.dense_layers,
                                  vocab=args.vocab)
    except (ValueError, FileExistsError) as exc:  # bad arguments: one line, no traceback
        print(f"make_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    m = info["model"]
    kind = f"AutoEP ({len(m.layers)} MoE layers x {m.layers[0].num_experts} experts, ep {args.ep})" if m.autoep else "dense"
    if m.tp > 1:
        kind += f", tp {m.tp}"
    if m.family != "toy":
        kind = f"{m.family} ({len(m.params)} params{'' if m.tp == 1 else ' per tp rank'}), {kind}"
    print(f"{tag_dir}: {info['numel']:,} params, {kind}, ZeRO-{args.stage} {args.dtype} dp {args.dp}; "
          f"{info['files']} files, {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.2f} s "
          f"(plan {info['plan_seconds']:.2f} s; {info['bytes'] / 1e9 / info['seconds']:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

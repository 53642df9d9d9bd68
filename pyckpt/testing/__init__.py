"""Synthetic DeepSpeed ZeRO checkpoints at benchmark scale, written in seconds: what the tests and the
benchmarks make their inputs with.

    from pyckpt.testing import make_checkpoint
    make_checkpoint(OUT, params="1B", dp=64, stage=2)      # python benchmarks/make_checkpoint.py OUT ...

A real save at dp 64 needs 64 ranks holding the whole model; this writes the files
DeepSpeed 0.19.8's ``save_checkpoint`` would write for the same model and topology (tp = pp = 1,
torch Adam after one step, ``client_state={'universal_checkpoint_info': {}}``), with the same
pickled structure (key order, object types, storage sharing), so both ``ds_to_universal.py`` and
pyckpt accept them. Only the tensor values are made up.

Values cost nothing: one noise file of random float32 in [-1, 1] (any 4-byte-aligned window is a
finite float), non-negative float32 for ``exp_avg_sq``, random bf16, zeros for padding and the
Adam step. Every tensor is a list of byte ranges of that file (wrapping around its regions, whose
lengths are primes so that wraps never line up), and pyckpt's native executor copies them into
the archives. A parameter's state is one contiguous window of the noise in its flat group, split
exactly as ZeRO splits the group, so a converter that takes a fragment from the wrong offset or
rank produces visibly different values. No tensor is built in memory: the generator stays near
100 MB of RSS at any size (most of it the noise file's pages), ~200 MB for ZeRO-3 at dp 4096.

The layouts this reproduces (as DeepSpeed 0.19.8's engine and ZeRO optimizers save them):
* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (module = views of the padded bit16 flat group) and one
  optimizer shard per dp rank: flat groups padded to ``2*W``, partition ``P = N_pad/W``,
  ``single_partition_of_fp32_groups`` with padding stripped (a view of the P-long storage),
  moments of length P, ``param_slice_mappings`` of the params overlapping the partition.
* ZeRO-3: per dp rank a model-state file (0-numel placeholders) and a shard whose sub-groups hold
  ``ceil(n/W)`` elements per param (``fp32_flat_groups`` tagged with ``ds_id``).
* AutoEP (Mixtral-like ``model.layers.{i}.mlp.experts.w1/w2/w3``): a second param group
  ``ep_size_{ep}`` partitioned over the expert-data-parallel group, ``ds_autoep_layers``, and
  per-expert files (ZeRO-1/2) or the partition-native layout (ZeRO-3).

Parameter layouts: the default toy stacks (few, odd-shaped tensors), or with ``--family`` a real
model's names and tensor count at any width: ``llama`` (LlamaForCausalLM: 9 per layer + 3, so 723 at
80 layers; with ``--tp``, cut and described as DeepSpeed AutoTP does), ``mixtral`` and ``deepseek``
(DeepSeek-V3: MLA attention, 3 dense layers, then routed + shared experts) as DeepSpeed AutoEP
leaves them. ``--hidden 8`` keeps metadata-heavy checkpoints (thousands of ranks or expert files)
small on disk. Planning costs O(what each file holds): no rank rescans the model, and archives go
to the executor in batches, so memory stays flat in dp.

Modules: DeepSpeed's pickled records (:mod:`.records`), the noise file and views of it (:mod:`.noise`),
parameter layouts (:mod:`.models`), the files of a topology (:mod:`.zero_writer`), and the entry
points (:mod:`.synthetic`). Its output is proven format-exact by DeepSpeed's converter accepting it
(tests/project/test_make_checkpoint.py).

Import rule: a writer of DeepSpeed's ZeRO files through the library's own executor: ``execution``,
``planning``, ``formats`` and the vocabulary; no reader of checkpoints, so that what it writes is not
shaped by what pyckpt reads.
"""

from .models import (FAMILIES, FAMILY_EXPERTS, VOCAB_TP, WEIGHTS, Model, MoELayer, autoep_model, autotp_map,
                     deepseek_model, dense_model, llama_model, mixtral_model, size_model, tp_model)
from .synthetic import build_plan, check_topology, make_checkpoint, parse_count
from .zero_writer import Topology, ZeroWriter

__all__ = ["make_checkpoint", "build_plan", "check_topology", "parse_count", "Model", "MoELayer", "Topology",
           "ZeroWriter", "FAMILIES", "FAMILY_EXPERTS", "VOCAB_TP", "WEIGHTS", "autoep_model", "autotp_map",
           "deepseek_model", "dense_model", "llama_model", "mixtral_model", "size_model", "tp_model"]

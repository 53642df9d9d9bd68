"""The logical checkpoint state: what a checkpoint holds, named by what it is rather than where a
format would put it.

A reader of an input format fills one: every parameter's states (``fp32``, ``exp_avg``,
``exp_avg_sq``, ``step``), each the value a Universal Checkpoint's ``zero/<name>/<state>.pt`` holds
(a tensor made of byte pieces of the input, or a dict of it and its merge markers, or a step
number); the optimizer's global state; the model-state files. A writer of an output format turns it
into a plan of byte copies (:mod:`pyckpt.universal.write` for the universal layout), and
the other consumers (export, direct resume, verify) look parameters up by name. A reader told which
states are wanted (``states``) leaves the others out: an export needs only the fp32 masters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..errors import CheckpointFormatError, quoted

# What an Adam-trained ZeRO checkpoint keeps per parameter, in the order it is written: the fp32
# master and Adam's two moments, each a flat tensor of the parameter's elements, then the step. The
# one list of these names: readers, writers and the load backend take them from here.
FP32 = "fp32"
MOMENTS = ("exp_avg", "exp_avg_sq")
TENSOR_STATES = (FP32, ) + MOMENTS
STEP = "step"
ALL_STATES = TENSOR_STATES + (STEP, )


@dataclass
class ModelFile:
    """A model-state file of the input as the output carries it: ``obj`` to write (re-saved with
    new metadata), or ``source`` (a parsed, checked input file) to copy byte for byte."""

    name: str
    obj: Any = None
    source: Any = None


@dataclass
class CheckpointState:
    states: Optional[Tuple[str, ...]] = None  # the states a reader fills; None: all
    # parameter -> state name -> value, both in the order the reader found them
    params: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    optimizer: Any = None  # the torch optimizer's global state (param groups, hyper-parameters)
    model_files: List[ModelFile] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what a --dry-run should tell besides the files
    # ("param", name, state) / ("optimizer",) / ("model", index): the order of everything put, so a
    # writer lays out its files in the order they were found
    order: List[tuple] = field(default_factory=list, repr=False)

    def wants(self, state: str) -> bool:
        return self.states is None or state in self.states

    def wanted(self, states: Iterable[str]) -> List[str]:
        return [s for s in states if self.wants(s)]

    def put(self, name: str, state: str, value: Any) -> None:
        held = self.params.setdefault(name, {})
        if state in held:
            # Two inputs for one parameter's state would leave only one of them in any output.
            raise CheckpointFormatError(f"two values found for the {state} state of parameter {quoted(name)}: refusing "
                                        "to let one replace the other")
        held[state] = value
        self.order.append(("param", name, state))

    def put_optimizer(self, value: Any) -> None:
        self.optimizer = value
        self.order.append(("optimizer", ))

    def put_model_file(self, name: str, obj: Any) -> None:
        self.model_files.append(ModelFile(name, obj=obj))
        self.order.append(("model", len(self.model_files) - 1))

    def copy_model_file(self, name: str, source: Any) -> None:
        self.model_files.append(ModelFile(name, source=source))
        self.order.append(("model", len(self.model_files) - 1))

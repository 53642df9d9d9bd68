"""What an input path is (pyckpt/inputs/dispatch.py): ``open_checkpoint`` tells a DCP folder from a
DeepSpeed checkpoint by the DCP reader's one rule, reads nothing to decide, and opens each with its
reader, whose refusals (a file, a missing path, a link out of the folder) stay one line naming the path
and the rule. Every command and ``pyckpt.export_hf`` dispatch through it, and nothing else in the
package asks the rule itself.

Inputs are made in this process: ZeRO checkpoints by pyckpt.testing, a Universal Checkpoint converted
from one, DCP folders by torch's own ``dcp.save`` (one rank, no process group). Fast: no DeepSpeed."""

import ast
import os
import pathlib
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pyckpt
import pyckpt.testing as mc
from pyckpt.dcp.read import DcpCheckpoint
from pyckpt.errors import CheckpointFormatError, VerifyInputError
from pyckpt.inputs.dispatch import DCP, DEEPSPEED, InputCheckpoint, open_checkpoint
from pyckpt.universal.read import UniversalCheckpoint
from pyckpt.zero.discovery import ZeroCheckpoint

PACKAGE = pathlib.Path(pyckpt.__file__).resolve().parent


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    tag = mc.make_checkpoint(root / "ck", params=20000, dp=2, stage=2)
    pyckpt.convert_to_universal(tag, root / "ck" / "uni")  # writes latest_universal beside it
    only_universal = root / "only_universal"  # a folder holding latest_universal and no latest
    only_universal.mkdir()
    shutil.copytree(root / "ck" / "uni", only_universal / "uni")
    (only_universal / "latest_universal").write_text("uni")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving on one rank"
        dcp.save({"model": {"w": torch.ones(4, 4), "b": torch.zeros(4)}, "step": 3},
                 storage_writer=FileSystemWriter(str(root / "dcp")))
        dcp.save({"w": torch.ones(4, 4)},
                 storage_writer=HuggingFaceStorageWriter(str(root / "dcp_safetensors"), save_distributed=True))
    return {"root": root, "tag": tag, "ck": root / "ck", "universal": root / "ck" / "uni",
            "only_universal": only_universal, "dcp": root / "dcp", "dcp_safetensors": root / "dcp_safetensors"}


def test_a_dcp_folder_is_dcp_and_opens_with_the_dcp_reader(inputs):
    for name, entries in (("dcp", {"model.w", "model.b", "step"}), ("dcp_safetensors", {"w"})):
        opened = open_checkpoint(inputs[name])
        assert opened == InputCheckpoint(str(inputs[name]), DCP)
        ck = opened.read()
        assert isinstance(ck, DcpCheckpoint) and set(ck.entries()) == entries


def test_a_zero_checkpoint_is_deepspeed_and_opens_with_zero_discovery(inputs):
    for path in (inputs["tag"], inputs["ck"]):  # the tag folder, and the folder holding latest (and latest_universal)
        opened = open_checkpoint(path)
        assert opened.kind == DEEPSPEED and opened.path == str(path)
        ck = opened.read()
        assert type(ck) is ZeroCheckpoint and (ck.stage, ck.dp) == (2, 2)
        assert os.path.samefile(ck.folder, inputs["tag"])


def test_a_universal_checkpoint_is_deepspeed_and_opens_with_the_universal_reader(inputs):
    for path, folder in ((inputs["universal"], inputs["universal"]),
                         (inputs["only_universal"], inputs["only_universal"] / "uni")):
        opened = open_checkpoint(path)
        assert opened.kind == DEEPSPEED
        ck = opened.read()
        assert type(ck) is UniversalCheckpoint and os.path.samefile(ck.folder, folder)


@pytest.mark.parametrize("make,rule", [
    (lambda root: root / "missing", "not a folder"),
    (lambda root: _file(root / "a_file"), "not a folder"),
    (lambda root: _link(root / "dangling", "/nonexistent-pyckpt-target"), "not a folder"),
    (lambda root: _folder(root / "empty"), "not a DeepSpeed ZeRO checkpoint folder")])
def test_what_is_neither_is_refused_by_the_deepspeed_reader_in_one_line(tmp_path, make, rule):
    """Deciding the kind raises nothing (a command checks its flags first); reading names the path and the rule."""
    path = make(tmp_path)
    opened = open_checkpoint(path)
    assert opened.kind == DEEPSPEED
    with pytest.raises(CheckpointFormatError) as info:
        opened.read()
    message = str(info.value)
    assert message.startswith(f"{path}: ") and rule in message and "\n" not in message


def test_deciding_the_kind_reads_no_file(tmp_path):
    """A .metadata that is a FIFO would block any read of it: the kind is decided from names alone, and the
    reader refuses what is not a regular file."""
    folder = _folder(tmp_path / "fifo")
    os.mkfifo(folder / ".metadata")
    opened = open_checkpoint(folder)
    assert opened.kind == DCP
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        opened.read()


def test_a_link_out_of_the_folder_is_refused_by_the_reader_it_is_dispatched_to(inputs, tmp_path):
    dcp_link = _folder(tmp_path / "dcp_link")
    os.symlink(inputs["dcp"] / ".metadata", dcp_link / ".metadata")
    opened = open_checkpoint(dcp_link)
    assert opened.kind == DCP
    with pytest.raises(CheckpointFormatError) as info:
        opened.read()
    assert str(info.value).startswith(f"{dcp_link / '.metadata'}: ") and "outside its folder" in str(info.value)

    tag_link = _folder(tmp_path / "tag_link")
    for name in os.listdir(inputs["tag"]):
        os.symlink(inputs["tag"] / name, tag_link / name)
    opened = open_checkpoint(tag_link)
    assert opened.kind == DEEPSPEED
    with pytest.raises(CheckpointFormatError, match="outside its folder") as info:
        opened.read()
    assert str(tag_link) in str(info.value) and "\n" not in str(info.value)


def test_export_hf_takes_any_input_through_the_dispatch(inputs, tmp_path):
    from pyckpt.inputs.export import export_hf
    assert pyckpt.export_hf is export_hf
    from_dcp = pyckpt.export_hf(inputs["dcp"], tmp_path / "a", dry_run=True, model_key="model")
    from_zero = pyckpt.export_hf(inputs["tag"], tmp_path / "b", dry_run=True)
    from_universal = pyckpt.export_hf(inputs["universal"], tmp_path / "c", dry_run=True)
    assert from_dcp.tensors == 2 and from_zero.tensors == from_universal.tensors > 2
    assert not any((tmp_path / name).exists() for name in "abc")


def test_verify_against_of_a_dcp_folder_pyckpt_did_not_write_names_the_rule(inputs, capsys):
    """torch's safetensors layout is a DCP folder for verify as for every command: --against plans pyckpt's
    export again, so a folder it did not write is refused for that, not for lacking a Universal Checkpoint's zero/."""
    from pyckpt.cli import main
    assert main(["verify", str(inputs["dcp_safetensors"]), "--against", str(inputs["tag"])]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and str(inputs["dcp_safetensors"] / ".pyckpt-export.json") in line
    assert "only a DCP folder pyckpt exported can be verified against its input" in line
    from pyckpt.dcp.verify import verify_dcp
    with pytest.raises(VerifyInputError, match="only a DCP folder pyckpt exported"):
        verify_dcp(inputs["dcp_safetensors"], against=inputs["tag"])


def test_nothing_but_the_dispatch_asks_whether_a_path_is_a_dcp_folder():
    """One rule, asked in one place: every other module goes through open_checkpoint."""
    askers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "is_dcp_folder" and module != "dcp/read.py":
                askers.append(f"{module} defines it")
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in ("is_dcp_folder", "is_dcp_input") and module != "inputs/dispatch.py":
                    askers.append(f"{module} calls it")
    assert askers == []


def _file(path):
    path.write_text("x")
    return path


def _folder(path):
    path.mkdir()
    return path


def _link(path, target):
    os.symlink(target, path)
    return path

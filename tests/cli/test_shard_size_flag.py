"""``--max_shard_size`` is parsed and checked once, by its argparse type (pyckpt/cli/common.py
``shard_size_flag``): the command holds bytes whichever input it dispatches to, a DeepSpeed checkpoint
or a DCP folder, and a bad size is one usage error naming the flag for both. Fast: synthetic inputs."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import pyckpt
import pyckpt.testing as mc
from pyckpt.cli import main, parse


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizes")
    tag = mc.make_checkpoint(root / "ck", params=20000, dp=2, stage=2)
    from torch.distributed.checkpoint import FileSystemWriter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving on one rank"
        dcp.save({"model": {"w": torch.ones(4, 4), "b": torch.zeros(4)}},
                 storage_writer=FileSystemWriter(str(root / "dcp")))
    return {"tag": tag, "dcp": root / "dcp"}


@pytest.mark.parametrize("given,size", [(None, 5 * 10**9), ("5GB", 5 * 10**9), ("2KB", 2000), ("1234", 1234),
                                        ("1.5GB", 1_500_000_000), (" 3 mb ", 3_000_000)])
def test_the_flag_gives_bytes(given, size):
    argv = ["export", "in", "out"] + ([] if given is None else ["--max_shard_size", given])
    assert parse(argv)[2].max_shard_size == size


@pytest.mark.parametrize("input_name", ["tag", "dcp"])
def test_a_bad_size_is_one_usage_error_for_every_input(inputs, tmp_path, capsys, input_name):
    with pytest.raises(SystemExit) as info:
        main(["export", str(inputs[input_name]), str(tmp_path / "out"), "--max-shard-size", "5XB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert err[-1].endswith("error: argument --max_shard_size/--max-shard-size: max_shard_size '5XB' is not a size "
                            "like '5GB', '500MB' or a number of bytes")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("input_name,size,files", [("tag", "2KB", None), ("dcp", "64", 2)])
def test_the_command_splits_as_the_library_does(inputs, tmp_path, input_name, size, files):
    """The bytes the flag gives split the weights as the library's own reading of the same text."""
    assert main(["export", str(inputs[input_name]), str(tmp_path / "cli"), "--max_shard_size", size, "-q"]) == 0
    pyckpt.export_hf(inputs[input_name], tmp_path / "library", max_shard_size=size)
    names = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "library").iterdir())
    assert "model.safetensors.index.json" in names
    assert files is None or len([n for n in names if n.endswith(".safetensors")]) == files
    for name in names:
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "library" / name).read_bytes(), name


@pytest.mark.parametrize("size,ok", [("5GB", True), ("5000000000", True), ("5000MB", True), ("1GB", False)])
def test_format_dcp_takes_the_default_size_however_written_and_refuses_another(inputs, tmp_path, capsys, size, ok):
    argv = ["export", str(inputs["tag"]), str(tmp_path / "out"), "--format", "dcp", "--max_shard_size", size,
            "--dry-run"]
    if ok:
        assert main(argv) == 0
        return
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "--max_shard_size, --torch-bin and --safe_serialization are for Hugging Face files, not --format dcp" \
        in capsys.readouterr().err

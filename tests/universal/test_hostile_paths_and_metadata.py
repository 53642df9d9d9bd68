"""Hostile checkpoints: names that would become paths outside OUTPUT, aliases, tensor views reaching
outside their bytes, copied files with corrupt metadata, special files, output folders that overlap
the input. Each is refused with one line naming the file, before anything is written, and the input
is left byte for byte as it was."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

import pyckpt
from pyckpt import CheckpointFormatError
from pyckpt.formats.torch_zip import SourceFile
from pyckpt.planning.plan import Plan

from compare import digest
from edit import copy_checkpoint, rewrite


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


def _model_file(tag):
    return sorted(tag.glob("*model_states.pt"))[0]


def _optim_file(tag, rank=0):
    return next(tag.glob(f"*zero_pp_rank_{rank}_*optim_states.pt"))


def _rename_key(mapping, old, new):
    items = [(new if k == old else k, v) for k, v in mapping.items()]
    mapping.clear()
    mapping.update(items)


BAD_NAMES = ["../../../../x", "/tmp/abs", "a/b", "x/../l0.weight", "", "a\x00b", "a..b", ".hidden", "trailing.",
             "a\nb", "x" * 300, "back\\slash"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=[repr(b)[:20] for b in BAD_NAMES])
def test_module_key_that_is_not_a_parameter_name_is_refused(bad, checkpoints, tmp_path):
    # The fallback writes zero/<module key>/fp32.pt for module entries without optimizer state.
    root, tag = copy_checkpoint(checkpoints["s1_frozen_tied"].tag_dir, tmp_path)
    model = _model_file(tag)

    def edit(obj):
        key = next(iter(obj["module"]))
        _rename_key(obj["module"], key, bad)

    rewrite(model, edit)
    before = digest(root)
    work = tmp_path / "work"
    out = work / "a" / "b" / "u"
    with pytest.raises(CheckpointFormatError, match=f"{model}.*module key") as info:
        pyckpt.convert_to_universal(root, out)
    assert "\n" not in str(info.value)
    assert not work.exists() or _tree(work) in ([], ["a"], ["a", "a/b"])
    assert not (tmp_path / "x").exists() and not os.path.exists("/tmp/abs")
    assert digest(root) == before


@pytest.mark.parametrize("bad", ["../escape", "sub/dir", "a..b"])
def test_zero3_param_shapes_name_is_refused(bad, checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s3_fp32_dp2_subgroups"].tag_dir, tmp_path)
    model = _model_file(tag)

    def edit(obj):
        group = obj["param_shapes"][0]
        _rename_key(group, next(iter(group)), bad)

    rewrite(model, edit)
    with pytest.raises(CheckpointFormatError, match=f"{model}: param_shapes\\[0\\] key"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")
    assert not (tmp_path / "out" / "u").exists() and not (tmp_path / "escape").exists()


def test_slice_mapping_name_is_refused(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    optim = _optim_file(tag, 1)

    def edit(obj):
        mapping = obj["optimizer_state_dict"]["param_slice_mappings"][0]
        _rename_key(mapping, next(iter(mapping)), "../../pwn")

    rewrite(optim, edit)
    with pytest.raises(CheckpointFormatError, match=f"{optim}: param_slice_mappings\\[0\\] key '../../pwn'"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


def test_two_parameters_on_one_path_are_refused(checkpoints, tmp_path):
    # A ZeRO-3 model listing one name in two sub-groups would write its file twice, the second
    # replacing the first.
    root, tag = copy_checkpoint(checkpoints["s3_fp32_dp2_subgroups"].tag_dir, tmp_path)

    def edit(obj):
        groups = obj["param_shapes"]
        first = next(iter(groups[0]))
        second = next(iter(groups[1]))
        _rename_key(groups[1], second, first)

    for model in tag.glob("*model_states.pt"):
        rewrite(model, edit)
    with pytest.raises(CheckpointFormatError, match="more than once|same file"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")
    assert not (tmp_path / "out" / "u").exists()


def test_plan_refuses_paths_outside_and_duplicates():
    plan = Plan()
    for bad in ("../x.pt", "/abs.pt", "a/../b.pt", "a//b.pt", "./a.pt", ""):
        with pytest.raises(CheckpointFormatError, match="inside the output folder"):
            plan.add_archive(bad, {})
    plan.add_archive("zero/a/fp32.pt", {})
    with pytest.raises(CheckpointFormatError, match="same file 'zero/a/fp32.pt'"):
        plan.add_archive("zero/a/fp32.pt", {})


# -- tensor references -------------------------------------------------------------------------

def _first_fp32(obj):
    return obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]


@pytest.mark.parametrize("change,message", [
    (lambda t: setattr(t, "offset", -1), "storage_offset -1 is out of range"),
    (lambda t: setattr(t, "offset", 5), "past the end of storage record"),
    (lambda t: setattr(t, "shape", (t.storage.numel - t.offset + 1, )), "past the end of storage record"),
    (lambda t: setattr(t, "stride", (-1, )), "stride entry -1 is out of range"),
    (lambda t: setattr(t, "shape", (2, t.shape[0])), "differ in length"),
], ids=["negative-offset", "offset-past-end", "shape-past-end", "negative-stride", "rank-mismatch"])
def test_tensor_view_outside_its_storage_is_refused(change, message, checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    optim = _optim_file(tag, 1)
    rewrite(optim, lambda obj: change(_first_fp32(obj)))
    with pytest.raises(CheckpointFormatError, match=f"{optim}: .*{message}"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")
    assert not (tmp_path / "out" / "u").exists()


def _repack(path, edit_members):
    """Rewrites a torch.save ZIP with edited members (stored, as torch writes them)."""
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    members = edit_members(members)
    tmp = f"{path}.repack"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data)
    os.replace(tmp, path)


def test_storage_larger_than_its_record_is_refused(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    optim = _optim_file(tag, 0)
    key = _first_fp32(SourceFile(str(optim)).load()).storage.key
    _repack(optim, lambda ms: [(n, d[:-4] if n.endswith(f"/data/{key}") else d) for n, d in ms])
    with pytest.raises(CheckpointFormatError, match=f"{optim}: record .*/data/{key} holds"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


def test_copied_model_file_with_corrupt_tensor_sizes_is_refused(checkpoints, tmp_path):
    # Model-state files are copied into the output whole; they must pass the same checks as the
    # files pyckpt reads, or DeepSpeed only finds out when it resumes.
    root, tag = copy_checkpoint(checkpoints["s3_fp32_dp2_subgroups"].tag_dir, tmp_path)
    model = sorted(tag.glob("*model_states.pt"))[-1]  # a rank the plan itself never reads

    def edit(obj):
        t = _any_tensor(obj["module"])  # ZeRO-3 keeps 0-element placeholders here: one element is too many
        t.shape, t.stride = (t.storage.numel + 1, ), (1, )

    rewrite(model, edit)
    with pytest.raises(CheckpointFormatError, match=f"{model}: .*past the end"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")
    assert not (tmp_path / "out" / "u").exists()


def _any_tensor(obj):
    from pyckpt.formats.pickle_read import TensorRef
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, TensorRef):
            return x
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    raise AssertionError("no tensor")


def test_partition_count_zero_is_a_format_error(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    optim = _optim_file(tag, 0)
    rewrite(optim, lambda obj: obj["optimizer_state_dict"].__setitem__("partition_count", [0]))
    with pytest.raises(CheckpointFormatError, match=f"{optim}: partition_count\\[0\\] is 0"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


def test_fragment_without_start_is_a_format_error(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    optim = _optim_file(tag, 1)

    def edit(obj):
        frag = next(iter(obj["optimizer_state_dict"]["param_slice_mappings"][0].values()))
        frag._state.pop("start")

    rewrite(optim, edit)
    with pytest.raises(CheckpointFormatError, match=f"{optim}: param_slice_mappings\\[0\\]\\[.*\\].start must be"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


def test_missing_optimizer_group_state_is_a_format_error(checkpoints, tmp_path):
    # Was a bare `pyckpt: error: 0` (KeyError) from the ZeRO-3 planner.
    root, tag = copy_checkpoint(checkpoints["s3_fp32_dp2_subgroups"].tag_dir, tmp_path)
    optim = _optim_file(tag, 1)
    rewrite(optim, lambda obj: obj["optimizer_state_dict"]["optimizer_state_dict"]["state"].pop(0))
    with pytest.raises(CheckpointFormatError, match=f"{optim}: optimizer state of sub-group 0 is missing"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


def test_oversized_pickle_is_refused_before_reading(checkpoints, tmp_path, monkeypatch):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    monkeypatch.setenv("PYCKPT_MAX_PICKLE_BYTES", "100")
    with pytest.raises(CheckpointFormatError, match="data.pkl is .* bytes, more than the 100-byte cap"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


# -- special files -----------------------------------------------------------------------------

def _run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "pyckpt.convert", *map(str, args)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), timeout=timeout)


def test_fifo_named_like_a_shard_is_refused_not_waited_on(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    optim = _optim_file(tag, 1)
    os.remove(optim)
    os.mkfifo(optim)
    proc = _run_cli(root, tmp_path / "out" / "u", timeout=60)  # a hang fails the test by timeout
    assert proc.returncode == 1, proc.stderr
    assert str(optim) in proc.stderr and "FIFO" in proc.stderr and proc.stderr.count("\n") == 1


def test_fifo_named_latest_is_refused(checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    os.remove(root / "latest")
    os.mkfifo(root / "latest")
    proc = _run_cli(root, tmp_path / "out" / "u", timeout=60)
    assert proc.returncode == 1 and "latest: is a FIFO, not a regular file" in proc.stderr, proc.stderr


@pytest.mark.parametrize("tag_text", ["../../elsewhere", "/etc", "a/b", ".."])
def test_latest_naming_a_folder_outside_is_refused(tag_text, checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    (root / "latest").write_text(tag_text)
    with pytest.raises(CheckpointFormatError, match="not a folder name beside it"):
        pyckpt.convert_to_universal(root, tmp_path / "out" / "u")


# -- output overlapping the input --------------------------------------------------------------

@pytest.mark.parametrize("where", ["tag", "root-is-input", "inside-tag", "ancestor", "symlink-to-tag"])
def test_output_overlapping_the_input_is_refused_even_with_overwrite(where, checkpoints, tmp_path):
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    given = {"root-is-input": root}.get(where, tag)
    out = {"tag": tag, "root-is-input": root, "inside-tag": tag / "u", "ancestor": tmp_path,
           "symlink-to-tag": tmp_path / "link"}[where]
    if where == "symlink-to-tag":
        os.symlink(tag, out)
    before = digest(root)
    proc = _run_cli("--overwrite", given, out)
    assert proc.returncode == 1, proc.stderr
    assert "input checkpoint folder" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert digest(root) == before
    assert not (root / "latest_universal").exists() and not (tmp_path / "latest_universal").exists()


def test_output_beside_the_tag_inside_the_save_dir_is_allowed(checkpoints, tmp_path):
    # DeepSpeed's own layout: ckpt/global_stepN_universal next to ckpt/global_stepN.
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    before = digest(tag)
    pyckpt.convert_to_universal(root, root / f"{tag.name}_universal")
    assert (root / "latest_universal").read_text() == f"{tag.name}_universal"
    assert digest(tag) == before


# Every file and folder the input consists of, not only its tag folder, is off limits to OUTPUT, for
# every writer and with or without --overwrite (issue 36, item 3: `export ck ck/latest --overwrite`
# replaced `latest` with the export). Fast: a synthetic checkpoint, the commands run in this process.

@pytest.fixture(scope="module")
def _save_folder(tmp_path_factory):
    """A save folder as a training run leaves it: a ZeRO-2 tag folder, `latest`, a Universal folder
    converted beside it with its `latest_universal`, and a model config beside the checkpoint."""
    import json

    import pyckpt.testing as mc

    tag = mc.make_checkpoint(tmp_path_factory.mktemp("made") / "ck", params=20000, dp=2, stage=2)
    pyckpt.convert_to_universal(tag.parent, tag.parent / f"{tag.name}_universal")
    (tag.parent / "config.json").write_text(json.dumps({"model_type": "toy", "dtype": "float32"}))
    return tag.parent, tag.name


def _save_copy(made, tmp_path):
    src, name = made
    root = tmp_path / "work" / "ck"
    shutil.copytree(src, root, symlinks=True)
    return root, root / name


def _in_process(command, *args):
    """(exit status, stderr) of ``pyckpt <command> ARGS`` run in this process."""
    import contextlib
    import io

    from pyckpt.cli import convert, export

    argv = [str(a) for a in args] + ["--quiet"]
    main = convert.main if command == "convert" else export.main
    if command == "export-dcp":
        argv += ["--format", "dcp"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(argv)
    return status, err.getvalue()


PART_OF_THE_INPUT = {
    # name: (OUTPUT, the input path the message names), both relative to the save folder's parent
    "latest": ("ck/latest", "ck/latest"),
    "latest_universal": ("ck/latest_universal", "ck/latest_universal"),
    "tag": ("ck/{tag}", "ck/{tag}"),
    "shard": ("ck/{tag}/zero_pp_rank_1_mp_rank_00_optim_states.pt", "ck/{tag}"),
    "model_states": ("ck/{tag}/mp_rank_00_model_states.pt", "ck/{tag}"),
    "save_dir": ("ck", "ck"),
    "ancestor": (".", "ck"),
    "dot_latest": ("ck/./latest", "ck/latest"),
    "climbing_latest": ("ck/../ck/latest", "ck/latest"),
    "link_to_latest": ("link", "ck/latest"),
    "link_to_tag": ("link", "ck/{tag}"),
}


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "no-overwrite"])
@pytest.mark.parametrize("given", ["save_dir", "tag"])
@pytest.mark.parametrize("where", list(PART_OF_THE_INPUT))
@pytest.mark.parametrize("command", ["convert", "export-hf", "export-dcp"])
def test_an_output_that_is_part_of_the_input_is_refused(command, where, given, overwrite, _save_folder, tmp_path):
    root, tag = _save_copy(_save_folder, tmp_path)
    work = root.parent
    output, named = (work / p.format(tag=tag.name) for p in PART_OF_THE_INPUT[where])
    if where.startswith("link_to_"):
        os.symlink(named, output)
    before = digest(work)
    status, err = _in_process(command, root if given == "save_dir" else tag, output,
                              *(["--overwrite"] if overwrite else []))
    assert status == 1, err
    assert err.count("\n") == 1 and err.startswith(f"pyckpt: error: {os.path.abspath(output)}: the output "), err
    assert "input checkpoint" in err and str(named.resolve()) in err, err
    assert digest(work) == before
    assert sorted(os.listdir(work)) == sorted(["ck"] + (["link"] if where.startswith("link_to_") else []))


@pytest.mark.parametrize("given", ["save_dir", "tag"])
@pytest.mark.parametrize("command", ["export-hf", "export-dcp-torchtitan"])
def test_an_output_that_is_the_model_config_an_export_reads_is_refused(command, given, _save_folder, tmp_path):
    """The model config beside the checkpoint is part of what an export reads (the Hugging Face
    export copies it, the DCP export's --torchtitan takes the attention shape from it): an OUTPUT of
    that name would replace it."""
    import json

    import pyckpt.testing as mc

    if command == "export-hf":
        root, tag = _save_copy(_save_folder, tmp_path)
        flags = []
    else:
        tag = mc.make_checkpoint(tmp_path / "work" / "ck", dp=2, stage=2, family="llama", layers=1, hidden=32,
                                 heads=4, kv_heads=2, vocab=64)
        root = tag.parent
        (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                                      "num_attention_heads": 4, "num_key_value_heads": 2}))
        flags = ["--torchtitan", "--initial-lr", "0.1"]
    before = digest(root.parent)
    status, err = _in_process(command.replace("-torchtitan", ""), root if given == "save_dir" else tag,
                              root / "config.json", "--overwrite", *flags)
    assert status == 1 and err.count("\n") == 1, err
    assert f"the output is the input checkpoint's file {root / 'config.json'}" in err, err
    assert digest(root.parent) == before


UNIVERSAL_PARTS = {
    "latest_universal": "ck/latest_universal",
    "folder": "ck/{tag}_universal",
    "zero": "ck/{tag}_universal/zero",
    "fp32": "ck/{tag}_universal/zero/l0.weight/fp32.pt",
    "save_dir": "ck",
    "ancestor": ".",
}


@pytest.mark.parametrize("given", ["folder", "save_dir"])
@pytest.mark.parametrize("where", list(UNIVERSAL_PARTS))
@pytest.mark.parametrize("command", ["export-hf", "export-dcp"])
def test_an_output_that_is_part_of_a_universal_input_is_refused(command, where, given, _save_folder, tmp_path):
    """A Universal folder exported (its folder, or a save folder whose `latest_universal` names it):
    its `zero/` tree, the pointer and the folders holding it are the input too."""
    root, tag = _save_copy(_save_folder, tmp_path)
    os.remove(root / "latest")  # a save folder with latest_universal alone is read as the Universal one
    universal = root / f"{tag.name}_universal"
    params = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    output = root.parent / UNIVERSAL_PARTS[where].format(tag=tag.name).replace("l0.weight", params[-1])
    assert where in ("save_dir", "ancestor") or os.path.lexists(output), output
    before = digest(root.parent)
    status, err = _in_process(command, universal if given == "folder" else root, output, "--overwrite")
    assert status == 1 and err.count("\n") == 1 and "input checkpoint" in err, err
    assert digest(root.parent) == before


@pytest.mark.parametrize("command", ["convert", "export-hf", "export-dcp"])
def test_the_cli_refuses_to_replace_latest_with_its_output(command, _save_folder, tmp_path):
    """The issue's own command lines, as a user runs them: exit 1, one line, `latest` still the file
    naming the tag."""
    root, tag = _save_copy(_save_folder, tmp_path)
    module = "pyckpt.convert" if command == "convert" else "pyckpt.export"
    extra = ["--format", "dcp"] if command == "export-dcp" else []
    proc = subprocess.run([sys.executable, "-m", module, "ck", "ck/latest", "--overwrite", *extra],
                          capture_output=True, text=True, cwd=root.parent, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{root / 'latest'}: the output is the input checkpoint's file {root / 'latest'}" in proc.stderr
    assert (root / "latest").read_text() == tag.name


@pytest.mark.parametrize("command", ["convert", "export-hf", "export-dcp"])
def test_the_library_refuses_an_output_that_is_part_of_the_input(command, _save_folder, tmp_path):
    """The Python API, not only the command line: each writer's entry point refuses, overwrite or not."""
    from pyckpt.dcp.export import export_dcp
    from pyckpt.huggingface.export import export_hf
    from pyckpt.universal.convert import convert_to_universal

    root, tag = _save_copy(_save_folder, tmp_path)
    write = {"convert": convert_to_universal, "export-hf": export_hf, "export-dcp": export_dcp}[command]
    before = digest(root)
    for output in (root / "latest", root / "latest_universal", root / "." / "latest"):
        for overwrite in (True, False):
            with pytest.raises(CheckpointFormatError, match="input checkpoint's file") as ei:
                write(root, output, overwrite=overwrite)
            assert "\n" not in str(ei.value)
    assert digest(root) == before


@pytest.mark.parametrize("command", ["convert", "export-hf", "export-dcp"])
def test_an_output_beside_the_checkpoint_is_still_allowed(command, _save_folder, tmp_path):
    """What the refusals must leave alone: an output in the save folder under a name of its own, or
    replacing another tag's folder there (what `universal=True` saves do each step), with the tag
    folder or the save folder given."""
    root, tag = _save_copy(_save_folder, tmp_path)
    before = digest(tag)
    assert _in_process(command, root, root / "beside") == (0, "")
    assert _in_process(command, tag, root / f"{tag.name}_universal", "--overwrite") == (0, "")
    assert digest(tag) == before
    assert (root / "latest").read_text() == tag.name


@pytest.mark.parametrize("command", ["convert", "export-hf", "export-dcp"])
def test_an_older_tag_given_may_not_replace_the_one_latest_names(command, _save_folder, tmp_path):
    """With an older tag folder given, the save folder's current checkpoint (the tag `latest` names)
    is still off limits; another older tag folder beside it is not."""
    root, tag = _save_copy(_save_folder, tmp_path)
    newest, older = root / "global_step2", root / "global_step0"
    shutil.copytree(tag, newest)
    shutil.copytree(tag, older)
    (root / "latest").write_text(newest.name)
    before = digest(newest)
    status, err = _in_process(command, tag, newest, "--overwrite")
    assert status == 1 and err.count("\n") == 1, err
    assert f"the output is the input checkpoint's folder {newest}" in err, err
    assert digest(newest) == before
    assert _in_process(command, tag, older, "--overwrite") == (0, "")


# A checkpoint folder may hold links (a downloaded archive can carry them). Whatever pyckpt reads
# through one must still lie inside the checkpoint: a link out of it is refused before anything is
# written, so no file of the machine ends up in an output a user publishes.
COMPANIONS = ["vocab.txt", "config.json", "tokenizer_config.json", "tokenizer.json", "generation_config.json",
              "merges.txt", "special_tokens_map.json"]


def _outside_secret(tmp_path):
    secret = tmp_path / "elsewhere" / "secret.json"
    secret.parent.mkdir()
    secret.write_text('{"token": "hunter2"}')
    return secret


@pytest.mark.parametrize("companion", COMPANIONS)
@pytest.mark.parametrize("target", ["proc", "outside"])
@pytest.mark.parametrize("layout", ["trainer", "tag"])
def test_an_export_companion_linking_out_of_the_checkpoint_is_refused(companion, target, layout, checkpoints,
                                                                       tmp_path):
    from pyckpt.huggingface.export import export_hf

    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    where = root if layout == "trainer" else tag  # beside the tag (HF Trainer) or in it (save glue)
    (where / "tokenizer.json").write_text('{"version": "1.0"}')  # a good companion beside the bad one
    link = where / companion
    if link.exists():
        link.unlink()
    os.symlink("/proc/self/environ" if target == "proc" else _outside_secret(tmp_path), link)
    before = digest(root)
    with pytest.raises(CheckpointFormatError) as ei:
        export_hf(root, tmp_path / "out")
    message = str(ei.value)
    assert message.startswith(str(link)) and "outside its folder" in message and "\n" not in message
    assert "hunter2" not in message
    assert not (tmp_path / "out").exists()
    assert [p for p in os.listdir(tmp_path) if "pyckpt" in p] == []
    assert digest(root) == before


def test_export_companions_linked_inside_the_checkpoint_are_copied(checkpoints, tmp_path):
    from pyckpt.huggingface.export import export_hf

    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    os.symlink("tok/tokenizer.json", root / "tokenizer.json")
    os.symlink(str(root / "tok" / "tokenizer.json"), root / "tokenizer_config.json")  # absolute, inside
    export_hf(root, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not os.path.islink(tmp_path / "out" / "tokenizer.json")
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"version": "1.0"}'


@pytest.mark.parametrize("victim", ["shard", "model", "latest", "tag"])
def test_a_checkpoint_file_linking_out_of_the_checkpoint_is_refused(victim, checkpoints, tmp_path):
    """The shards and model states are copied or gathered into the output: one that links to a
    torch.save file elsewhere (another run's checkpoint) is refused, as is a pointer or tag folder
    that leads out of the folder the user named."""
    root, tag = copy_checkpoint(checkpoints["s2_bf16_dp2"].tag_dir, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tag, elsewhere)
    if victim == "shard":
        link = _optim_file(tag, 1)
        link.unlink()
        os.symlink(elsewhere / link.name, link)
    elif victim == "model":
        link = _model_file(tag)
        link.unlink()
        os.symlink(elsewhere / link.name, link)
    elif victim == "latest":
        link = root / "latest"
        (tmp_path / "pointer").write_text(tag.name)
        link.unlink()
        os.symlink(tmp_path / "pointer", link)
    else:
        link = tag
        shutil.rmtree(tag)
        os.symlink(elsewhere, tag)
    before = digest(root)
    for run in (lambda: pyckpt.convert_to_universal(root, tmp_path / "out"),
                lambda: pyckpt.export_hf(root, tmp_path / "out")):
        with pytest.raises(CheckpointFormatError, match="outside its folder") as ei:
            run()
        assert str(ei.value).startswith(str(link))
        assert not (tmp_path / "out").exists()
    assert digest(root) == before


# A megabyte where a name or a marker goes: the one line that refuses it quotes a few hundred characters and
# says how long the rest was, naming the file. Fast: the save folder above, the commands run in this process.

MEGA = "h" * 1_000_000


@pytest.mark.parametrize("where", ["module_key", "param_shapes_key", "shared_params_alias"])
def test_a_megabyte_parameter_name_is_refused_in_one_short_line(where, _save_folder, tmp_path):
    root, tag = _save_copy(_save_folder, tmp_path)
    model = _model_file(tag)

    def edit(obj):
        if where == "module_key":
            _rename_key(obj["module"], next(iter(obj["module"])), MEGA)
        elif where == "param_shapes_key":
            _rename_key(obj["param_shapes"][0], next(iter(obj["param_shapes"][0])), MEGA)
        else:
            obj["shared_params"][MEGA] = next(iter(obj["param_shapes"][0]))

    rewrite(model, edit)
    for command in ("convert", "export-hf", "export-dcp"):
        status, err = _in_process(command, root, tmp_path / "out" / command)
        (line, ) = err.splitlines()
        assert status == 1 and len(line) < 1000, (command, line[:2000])
        assert f"{model}: " in line and "not a DeepSpeed parameter name" in line and "(1,000,000 characters)" in line


def test_a_megabyte_marker_in_a_universal_state_file_is_reported_in_one_short_line(_save_folder, tmp_path, capsys):
    """verify reports a universal state file's marker of the wrong type, quoting it: cut, with its length."""
    from pyckpt import cli

    root, tag = _save_copy(_save_folder, tmp_path)
    universal = root / f"{tag.name}_universal"
    fp32 = sorted(universal.glob("zero/*/fp32.pt"))[0]
    rewrite(fp32, lambda obj: obj.__setitem__("cat_dim", MEGA))
    assert cli.main(["verify", str(universal)]) == 1
    out, _ = capsys.readouterr()
    (line, ) = [x for x in out.splitlines() if "cat_dim" in x]
    assert len(line) < 1000 and str(fp32) in line and "(1,000,000 characters)" in line, line[:2000]

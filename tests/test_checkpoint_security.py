"""Loading a checkpoint never runs code from it (issue #18).

One tiny training (1 rank) writes a clean checkpoint and checks that it resumes bit-identically;
copies of it get a hostile ``.metadata`` (each would create a marker file if unpickled by
``pickle.load``), and every entry point that loads checkpoints must refuse them: exit non-zero,
name the ``.metadata`` file, and never create the marker.  Payloads:

* ``reduce``: a protocol-2 pickle whose ``__reduce__`` is ``os.system``;
* ``via_allowed_module``: protocol 4, ``STACK_GLOBAL`` of ``os.system`` in
  ``torch.distributed.checkpoint.metadata`` (a module DCP's classes live in, which imports ``os``);
* ``dotted``: the same with ``os.path.os.system`` (dotted-name traversal).
"""

import os
import pickle
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from megalm.checkpoint.safe_metadata import (
    CheckpointMetadataError,
    CheckpointSecurityError,
    SafeFileSystemReader,
    load_metadata,
)
from tests.distributed_harness import run_distributed
from tests.training_runs import losses as _losses
from tests.training_runs import metrics_argv, tiny_flags
from tests.training_runs import run_trainings as _run_trainings

REPO = Path(__file__).resolve().parents[1]
DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
PAYLOADS = ("reduce", "via_allowed_module", "dotted")
TINY = tiny_flags(
    num_layers="1",
    hidden_size="32",
    num_attention_heads="2",
    seq_length="16",
    vocab_size="128",
    lr="1e-3",
    seed="5",
    micro_batch_size="4",
    global_batch_size="4",
    split="100,0,0",
    train_iters="4",
)


def _short_str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def stack_global_payload(module: str, name: str, command: str) -> bytes:
    """Protocol 4: ``STACK_GLOBAL(module, name)(command)``, what ``pickle.load`` resolves by walking ``name``."""
    return b"\x80\x04" + _short_str(module) + _short_str(name) + b"\x93" + _short_str(command) + b"\x85R."


class _Reduce:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def payload(kind: str, marker: Path) -> bytes:
    command = f"touch {marker}"
    if kind == "reduce":
        return pickle.dumps(_Reduce(command), protocol=2)
    name = {"via_allowed_module": "os.system", "dotted": "os.path.os.system"}[kind]
    return stack_global_payload(DCP_METADATA_MODULE, name, command)


def _iteration_dir(root) -> Path:
    return Path(root) / "iter_0000002"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The clean checkpoint (iteration 2 of 4), resume runs, and one poisoned copy per payload."""
    tmp = tmp_path_factory.mktemp("sec")
    clean = str(tmp / "clean")
    runs = [
        metrics_argv(TINY, str(tmp), "straight"),
        metrics_argv(TINY, str(tmp), "first_half", "--exit-interval", "2", "--save", clean, "--save-interval", "100"),
        metrics_argv(TINY, str(tmp), "resumed", "--load", clean),
    ]
    codes = run_distributed(_run_trainings, 1, args=(runs,), timeout=240)[0]
    poisoned = {}
    for kind in PAYLOADS:
        root = tmp / f"poisoned_{kind}"
        shutil.copytree(clean, root)
        marker = tmp / f"marker_{kind}"
        (_iteration_dir(root) / ".metadata").write_bytes(payload(kind, marker))
        poisoned[kind] = (str(root), marker)
    return {"tmp": str(tmp), "clean": clean, "codes": codes, "poisoned": poisoned}


def _assert_refused(world, kind, code, message, where="pretrain"):
    root, marker = world["poisoned"][kind]
    assert code not in (0, None), (where, kind, code)
    assert str(_iteration_dir(root) / ".metadata") in message, (where, kind, message)
    assert "refusing to unpickle" in message, (where, kind, message)
    assert not marker.exists(), f"payload {kind} ran in {where}"


def test_payloads_run_under_plain_pickle(world, tmp_path):
    """The payloads are live: plain ``pickle.loads`` runs each (so the refusals below mean something)."""
    for kind in PAYLOADS:
        marker = tmp_path / kind
        pickle.loads(payload(kind, marker))
        assert marker.exists(), kind


def test_clean_checkpoint_resumes_bit_identically(world):
    """Also covered with dropout under TP2 x DP2 by tests/test_training.py::test_exact_resume."""
    assert world["codes"] == [0, 0, 0]
    tmp = world["tmp"]
    straight = _losses(tmp, "straight")
    assert len(straight) == 4
    assert _losses(tmp, "first_half") + _losses(tmp, "resumed") == straight


def test_clean_metadata_reads_as_plain_pickle_does(world):
    file = _iteration_dir(world["clean"]) / ".metadata"
    with open(file, "rb") as f:
        reference = pickle.load(f)  # our own, trusted file
    md = load_metadata(str(_iteration_dir(world["clean"])))
    assert md.state_dict_metadata == reference.state_dict_metadata
    assert md.storage_data == reference.storage_data
    assert md.storage_meta == reference.storage_meta
    assert "optimizer.decoder.layers.0.mlp.linear_fc1.weight.exp_avg" in md.state_dict_metadata


def _load_everything(runs, generate_argvs):
    """On this rank: each training run (exit codes), then tools/generate.py's main per argv ((code, stderr))."""
    import contextlib
    import io

    codes = _run_trainings(runs)
    generated = []
    for argv in generate_argvs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = _tool("generate.py")(argv)
        generated.append((code, err.getvalue()))
    return codes, generated


@pytest.mark.parametrize("world_size", [1, 2])
def test_pretrain_and_parallel_generate_refuse_poisoned_metadata(world, world_size):
    """pretrain() on 1 and 2 ranks (DP 2); generation with --tensor-model-parallel-size 2 on 2 ranks."""
    runs = [
        metrics_argv(
            TINY,
            world["tmp"],
            f"load_{kind}_{world_size}",
            "--load",
            world["poisoned"][kind][0],
            "--micro-batch-size",
            str(4 // world_size),
        )
        for kind in PAYLOADS
    ]
    generate = (
        [
            [
                "--load",
                world["poisoned"][kind][0],
                "--prompt",
                "1 2",
                "--max-new-tokens",
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--distributed-timeout-minutes",
                "2",
            ]
            for kind in PAYLOADS
        ]
        if world_size == 2
        else []
    )
    for codes, generated in run_distributed(_load_everything, world_size, args=(runs, generate), timeout=240):
        for kind, code in zip(PAYLOADS, codes):
            _assert_refused(world, kind, code, str(code))
        assert len(generated) == len(generate)
        for kind, (code, err) in zip(PAYLOADS, generated):
            _assert_refused(world, kind, code, err, where="generate --tensor-model-parallel-size 2")


def test_pretrain_gpt_script_exits_nonzero(world):
    kind = "via_allowed_module"
    env = dict(os.environ, PYTHONPATH=str(REPO), MEGALM_FORCE_CPU="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "pretrain_gpt.py"),
            *metrics_argv(TINY, world["tmp"], "script"),
            "--load",
            world["poisoned"][kind][0],
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=str(REPO),
    )
    _assert_refused(world, kind, proc.returncode, proc.stderr)


def _tool(name):
    return runpy.run_path(str(REPO / "tools" / name))["main"]


@pytest.mark.parametrize("kind", PAYLOADS)
def test_tools_refuse_poisoned_metadata(world, kind, tmp_path, capsys):
    root = world["poisoned"][kind][0]
    runs = {
        "inspect": (_tool("checkpoint/inspect.py"), [root]),
        "convert": (
            _tool("checkpoint/convert.py"),
            ["--to", "hf", "--load-dir", root, "--save-dir", str(tmp_path / "hf")],
        ),
        "generate": (_tool("generate.py"), ["--load", root, "--prompt", "1 2 3", "--max-new-tokens", "2"]),
    }
    for tool, (main, argv) in runs.items():
        code = main(argv)
        _assert_refused(world, kind, code, capsys.readouterr().err, where=tool)
    assert not (tmp_path / "hf").exists()


def test_tools_still_read_the_clean_checkpoint(world, tmp_path, capsys):
    assert _tool("checkpoint/inspect.py")([world["clean"]]) == 0
    assert "model tensors" in capsys.readouterr().out
    assert (
        _tool("checkpoint/convert.py")(["--to", "hf", "--load-dir", world["clean"], "--save-dir", str(tmp_path / "hf")])
        == 0
    )
    assert (tmp_path / "hf" / "config.json").is_file()


# --- the reader itself ----------------------------------------------------------------------------


def _plant(tmp_path, data: bytes) -> Path:
    d = tmp_path / "iter"
    d.mkdir(exist_ok=True)
    (d / ".metadata").write_bytes(data)
    return d


def _clean_metadata(world):
    with open(_iteration_dir(world["clean"]) / ".metadata", "rb") as f:
        return pickle.load(f)  # trusted: written by the fixture


def test_refusal_names_file_and_global(world, tmp_path):
    d = _plant(tmp_path, payload("via_allowed_module", tmp_path / "m"))
    with pytest.raises(CheckpointSecurityError) as e:
        load_metadata(str(d))
    assert str(d / ".metadata") in str(e.value)
    assert "'os.system' of module 'torch.distributed.checkpoint.metadata'" in str(e.value)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "module,name",
    [
        ("torch", "load"),
        ("builtins", "eval"),
        ("torch", "Size.__class__"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
        (DCP_METADATA_MODULE, "BytesStorageMetadata"),
        (DCP_METADATA_MODULE, "os"),
    ],
)
def test_only_exact_pairs_are_allowed(tmp_path, module, name):
    d = _plant(tmp_path, stack_global_payload(module, name, "x"))
    with pytest.raises(CheckpointSecurityError, match=f"{name!r} of module {module!r}"):
        load_metadata(str(d))


def test_state_is_never_set_on_a_class(tmp_path):
    """``BUILD`` on an allowed class would set class attributes process-wide: refused."""
    data = (
        b"\x80\x04"
        + _short_str(DCP_METADATA_MODULE)
        + _short_str("Metadata")
        + b"\x93"
        + b"N}"
        + _short_str("version")
        + _short_str("pwned")
        + b"s\x86b."
    )  # (None, {"version": "pwned"})
    d = _plant(tmp_path, data)
    with pytest.raises(CheckpointSecurityError, match="object state for"):
        load_metadata(str(d))
    assert "version" not in vars(dcp_metadata.Metadata) or vars(dcp_metadata.Metadata)["version"] != "pwned"


def test_storage_paths_stay_in_the_checkpoint_directory(world, tmp_path):
    md = _clean_metadata(world)
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../../etc/passwd"
    d = _plant(tmp_path, pickle.dumps(md))
    with pytest.raises(CheckpointSecurityError, match="not a file of the checkpoint directory"):
        load_metadata(str(d))


def test_byte_entries_are_refused(world, tmp_path):
    md = _clean_metadata(world)
    md.state_dict_metadata["extra"] = dcp_metadata.BytesStorageMetadata()
    d = _plant(tmp_path, pickle.dumps(md))
    with pytest.raises(CheckpointSecurityError, match="'BytesStorageMetadata'"):
        load_metadata(str(d))


def test_reader_refuses_byte_items_and_has_no_per_rank_fallback(world, tmp_path):
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = SafeFileSystemReader(str(_iteration_dir(world["clean"])))
    index = dcp_metadata.MetadataIndex("extra")
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=index,
        dest_offsets=torch.Size([0]),
        storage_index=index,
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    with pytest.raises(CheckpointSecurityError, match="pickled bytes"):
        reader.read_data(LoadPlan([item]), planner=None)
    # DCP falls back to __<rank>.metadata only for readers whose read_metadata takes keywords.
    d = tmp_path / "per_rank"
    d.mkdir()
    (d / "__0.metadata").write_bytes(payload("reduce", tmp_path / "m"))
    from torch.distributed.checkpoint.api import CheckpointException

    from megalm.checkpoint.dcp_io import load_sharded
    from megalm.param_layout import ShardedTensorSpec

    with pytest.raises(CheckpointException) as e:
        load_sharded({"model.x": ShardedTensorSpec.replicated(torch.zeros(2))}, str(d))
    why = str(e.value.failures[0])
    assert f"cannot read {d / '.metadata'}" in why and "rank local" not in why  # __0.metadata was never read
    assert not (tmp_path / "m").exists()


def test_malformed_metadata_is_an_error_naming_the_file(tmp_path):
    d = _plant(tmp_path, b"\x80\x04not a pickle")
    with pytest.raises(CheckpointMetadataError, match=str(d / ".metadata")):
        load_metadata(str(d))
    with pytest.raises(CheckpointMetadataError, match="cannot read"):
        load_metadata(str(tmp_path / "missing"))

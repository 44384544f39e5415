"""Checkpoints are verified; corrupt ones never load silently (issue #18, item 4).

One 2-rank training (TP2, so both ranks write tensor shards) saves checkpoints at iterations 2
and 4, and a run resumed from iteration 2 gives the reference losses.  Copies of that checkpoint
directory each get one corruption of iteration 4; in one second spawned group every copy must
stop ``pretrain_gpt`` before iteration 1 with ``checkpoint DIR is corrupt: FILE: reason;
previous: --ckpt-step 2``, and ``--ckpt-fallback-to-verified`` must load iteration 2 instead and
then reproduce the reference losses exactly.  ``--save`` that is not a writable directory fails
at start.  Disk-full and DCP errors on save/load become one-line ``CheckpointError`` s.
"""

import errno
import json
import os
import shutil
import subprocess
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megalm.checkpoint import dcp_io
from megalm.checkpoint import manifest as checkpoint_manifest
from megalm.checkpoint.async_writer import AsyncCheckpointWriter, AsyncSaveError
from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.load import load_checkpoint
from megalm.checkpoint.resume import TRACKER_FILENAME, read_tracker, verify_checkpoint
from megalm.checkpoint.safe_metadata import load_metadata
from megalm.checkpoint.save import check_save_dir, save_checkpoint
from megalm.parallel_state import get_process_groups
from tests.checkpoint_fixtures import save_random_model
from tests.configs import TINY_GPT, make_config
from tests.distributed_harness import run_distributed
from tests.logs import megalm_logs
from tests.training_runs import losses, metrics_argv, records, run_trainings, tiny_flags

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
    tensor_model_parallel_size="2",
)
ITER4 = "iter_0000004"


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _flip_tensor_bytes(it: Path) -> None:
    """Flip 64 bytes in the middle of the largest tensor item of rank 0's shard (tensor data, not a header)."""
    md = load_metadata(str(it))
    items = [info for info in md.storage_data.values() if info.relative_path == "__0_0.distcp"]
    item = max(items, key=lambda info: info.length)
    file = it / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    middle = item.offset + item.length // 2
    for i in range(middle - 32, middle + 32):
        data[i] ^= 0x5A
    file.write_bytes(bytes(data))


def _claim_iteration_2(it: Path) -> None:
    common = json.loads((it / "common.json").read_text())
    common["iteration"] = 2
    (it / "common.json").write_text(json.dumps(common))


# name -> (corruption of iter_0000004, the FILE: reason the message must give)
CORRUPTIONS = {
    "truncated_shard": (lambda it: _truncate(it / "__1_0.distcp"), "__1_0.distcp: truncated to"),
    "deleted_shard": (lambda it: (it / "__0_0.distcp").unlink(), "__0_0.distcp: missing"),
    "flipped_bytes": (_flip_tensor_bytes, "__0_0.distcp: sha256 mismatch"),
    "truncated_metadata": (lambda it: _truncate(it / ".metadata"), ".metadata: truncated to"),
    "truncated_rng": (lambda it: _truncate(it / "rng" / "rank_00001.pt"), "rng/rank_00001.pt: truncated to"),
    "inconsistent_common": (_claim_iteration_2, "common.json: says iteration 2, the directory is iteration 4"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    base = str(tmp / "base")
    first = [
        metrics_argv(
            TINY, str(tmp), "base", "--save", base, "--save-interval", "2", "--train-iters", "6", "--exit-interval", "4"
        ),
        metrics_argv(TINY, str(tmp), "from2", "--load", base, "--ckpt-step", "2", "--train-iters", "6"),
    ]
    first_codes = run_distributed(run_trainings, 2, args=(first,), timeout=240)[0]
    assert first_codes == [0, 0], first_codes
    cases = {}
    for name, (corrupt, _) in CORRUPTIONS.items():
        root = tmp / name
        shutil.copytree(base, root)
        corrupt(root / ITER4)
        cases[name] = str(root)
    fallback = tmp / "fallback"
    shutil.copytree(base, fallback)
    _flip_tensor_bytes(fallback / ITER4)
    incomplete = tmp / "fallback_incomplete"
    shutil.copytree(base, incomplete)
    (incomplete / ITER4 / ".metadata").unlink()
    legacy = tmp / "legacy_truncated_rng"  # no manifest: rank 1's unreadable RNG file must stop both ranks
    shutil.copytree(base, legacy)
    (legacy / ITER4 / "manifest.json").unlink()
    shutil.rmtree(legacy / ITER4 / "manifest")
    _truncate(legacy / ITER4 / "rng" / "rank_00001.pt")
    cases["legacy_truncated_rng"] = str(legacy)
    not_a_dir = tmp / "a_file"
    not_a_dir.write_text("x")
    runs = [metrics_argv(TINY, str(tmp), name, "--load", root, "--train-iters", "6") for name, root in cases.items()]
    runs += [
        metrics_argv(
            TINY, str(tmp), "fallback", "--load", str(fallback), "--train-iters", "6", "--ckpt-fallback-to-verified"
        ),
        metrics_argv(
            TINY,
            str(tmp),
            "fallback_incomplete",
            "--load",
            str(incomplete),
            "--train-iters",
            "6",
            "--ckpt-fallback-to-verified",
        ),
        metrics_argv(TINY, str(tmp), "save_file", "--save", str(not_a_dir), "--train-iters", "2"),
        metrics_argv(TINY, str(tmp), "save_under_file", "--save", str(not_a_dir / "sub"), "--train-iters", "2"),
    ]
    codes = run_distributed(run_trainings, 2, args=(runs,), timeout=300)
    names = list(cases) + ["fallback", "fallback_incomplete", "save_file", "save_under_file"]
    return {
        "tmp": str(tmp),
        "base": base,
        "cases": cases,
        "not_a_dir": str(not_a_dir),
        "codes": [dict(zip(names, rank_codes)) for rank_codes in codes],
    }


def _no_training(world, name):
    file = os.path.join(world["tmp"], f"{name}.jsonl")
    assert not os.path.exists(file) or records(world["tmp"], name) == [], name


def test_clean_checkpoints_have_manifests(world):
    it = Path(world["base"]) / ITER4
    index = json.loads((it / "manifest.json").read_text())
    assert index["iteration"] == 4 and index["world_size"] == 2 and index["algorithm"] == "sha256"
    listed = checkpoint_manifest.listed_files(str(it), index)
    on_disk = {
        str(p.relative_to(it))
        for p in it.rglob("*")
        if p.is_file() and "manifest" not in p.name and p.parent.name != "manifest"
    }
    assert set(listed) == on_disk, (set(listed), on_disk)
    for name, entry in listed.items():
        assert checkpoint_manifest.file_digest(str(it / name)) == (entry["size"], entry["sha256"]), name
    assert verify_checkpoint(str(it), 4) is None
    assert verify_checkpoint(str(it), 2) == "common.json: says iteration 4, the directory is iteration 2"


def test_legacy_checkpoint_with_an_unreadable_rng_file_stops_every_rank(world):
    """Without a manifest nothing is verified, but a rank that cannot read its RNG file stops
    every rank (the error is gathered) instead of leaving the others in the first step."""
    file = f"{world['cases']['legacy_truncated_rng']}/{ITER4}/rng/rank_00001.pt"
    for codes in world["codes"]:
        assert codes["legacy_truncated_rng"].startswith(f"error: cannot read {file}: "), codes
    _no_training(world, "legacy_truncated_rng")


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corruption_fails_before_iteration_1(world, name):
    root = world["cases"][name]
    expected = f"error: checkpoint {root}/{ITER4} is corrupt: {CORRUPTIONS[name][1]}"
    for rank, codes in enumerate(world["codes"]):
        message = codes[name]
        assert isinstance(message, str) and message.startswith(expected), (rank, message)
        assert message.endswith("; previous: --ckpt-step 2"), (rank, message)
        assert "\n" not in message, message
    _no_training(world, name)


@pytest.mark.parametrize("name", ["fallback", "fallback_incomplete"])
def test_fallback_loads_the_previous_checkpoint_and_resumes_exactly(world, name):
    """Flipped tensor bytes, or no .metadata at all (which fails at start without the flag)."""
    assert [c[name] for c in world["codes"]] == [0, 0]
    rows = records(world["tmp"], name)
    assert [r["iteration"] for r in rows] == [3, 4, 5, 6]
    reference = losses(world["tmp"], "from2")
    assert len(reference) == 4
    assert losses(world["tmp"], name) == reference


def test_save_that_is_not_a_writable_directory_fails_at_start(world):
    path = world["not_a_dir"]
    for codes in world["codes"]:
        assert codes["save_file"] == f"error: --save {path} is not a directory"
        assert codes["save_under_file"] == f"error: --save {path}/sub cannot be created: {path} is not a directory"
    _no_training(world, "save_file")
    _no_training(world, "save_under_file")


def test_inspect_verify(world, capsys):
    import runpy

    main = runpy.run_path(str(Path(__file__).resolve().parents[1] / "tools" / "checkpoint" / "inspect.py"))["main"]
    base = world["base"]
    assert main([base, "--verify"]) == 0
    it = f"{base}/{ITER4}"
    listed = checkpoint_manifest.listed_files(it, json.loads(Path(it, "manifest.json").read_text()))
    size = sum(f["size"] for f in listed.values())
    assert capsys.readouterr().out == f"verified: checkpoint {it}: {len(listed)} files, {size} bytes, sha256\n"
    assert main([f"{base}/iter_0000002", "--verify"]) == 0
    capsys.readouterr()
    root = world["cases"]["deleted_shard"]
    assert main([root, "--verify"]) == 1
    assert capsys.readouterr().out == f"corrupt: checkpoint {root}/{ITER4}: __0_0.distcp: missing\n"


def test_check_save_dir(tmp_path):
    """A missing --save is fine where it can be created (and is not created yet); a read-only
    directory (a read-only bind mount: root ignores permission bits) is refused."""
    target = tmp_path / "new" / "ckpts"
    check_save_dir(str(target))
    assert not (tmp_path / "new").exists()
    check_save_dir(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a read-only bind mount here")
    try:
        with pytest.raises(CheckpointError, match=f"^--save {ro} is not a writable directory: Read-only file system$"):
            check_save_dir(str(ro))
        with pytest.raises(CheckpointError, match=f"^--save {ro}/sub cannot be created: {ro} is not writable$"):
            check_save_dir(str(ro / "sub"))
    finally:
        subprocess.run(["umount", str(ro)], check=True)


# --- single-process: legacy checkpoints, async save, errors from DCP and the disk ------------


def test_checkpoint_without_manifest_loads_with_a_warning(tmp_path, capsys):
    from megalm.models import GPTModel

    cfg = make_config(TINY_GPT, vocab_size=128)
    saved = save_random_model(cfg, tmp_path, iteration=7)
    it = tmp_path / "iter_0000007"
    (it / "manifest.json").unlink()
    shutil.rmtree(it / "manifest")
    model = GPTModel(cfg, process_groups=get_process_groups())
    with megalm_logs("stderr"):
        load_checkpoint(str(tmp_path), [model], finetune=True)
    assert f"WARNING: checkpoint {it} has no manifest.json" in capsys.readouterr().err
    for (name, a), b in zip(saved.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    # Rank manifests without the index: the save never completed.
    saved = save_random_model(cfg, tmp_path, iteration=8)
    (tmp_path / "iter_0000008" / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"iter_0000008 is corrupt: manifest.json: missing "
        r"\(the save never completed\); previous: --ckpt-step 7",
    ):
        load_checkpoint(str(tmp_path), [model], finetune=True)


def _model():
    from megalm.models import GPTModel

    return GPTModel(
        make_config(TINY_GPT, vocab_size=20000), process_groups=get_process_groups()
    )  # a 2.5 MB word embedding


def test_async_save_writes_the_manifest_before_the_tracker(tmp_path):
    from megalm.checkpoint.rng import RNGState
    from megalm.checkpoint.stateful import CheckpointStates

    writer, states = AsyncCheckpointWriter(), CheckpointStates()
    states.register("rng", RNGState())  # as the trainer registers it: a per-rank file in the manifest
    save_checkpoint(str(tmp_path), 3, [_model()], async_writer=writer, states=states)
    assert writer.wait() == 3
    it = tmp_path / "iter_0000003"
    assert (it / "manifest.json").is_file() and read_tracker(str(tmp_path)) == 3
    assert os.path.getmtime(it / "manifest.json") <= os.path.getmtime(tmp_path / TRACKER_FILENAME)
    assert verify_checkpoint(str(it), 3) is None
    _truncate(it / "rng" / "rank_00000.pt")
    assert verify_checkpoint(str(it), 3).startswith("rng/rank_00000.pt: truncated to")


def _raise_enospc(path):
    def save(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "__0_0.distcp"))
        except OSError as e:
            raise CheckpointException("save", {0: (e, traceback.extract_tb(e.__traceback__))}) from None

    return save


@pytest.mark.parametrize("asynchronous", [False, True])
def test_dcp_enospc_becomes_a_checkpoint_error_naming_the_path(tmp_path, monkeypatch, asynchronous):
    """DCP reports a failed write as CheckpointException (a BaseException), wrapping the OSError."""
    path = str(tmp_path / "iter_0000005")
    monkeypatch.setattr(dcp_io.dcp, "save", _raise_enospc(path))
    writer = AsyncCheckpointWriter() if asynchronous else None
    expected = f"cannot write checkpoint {path}: No space left on device (OSError: [Errno 28] No space left on device"
    if asynchronous:
        save_checkpoint(str(tmp_path), 5, [_model()], async_writer=writer)
        with pytest.raises(AsyncSaveError, match="CheckpointError: " + _re(expected)):
            writer.wait()
    else:
        with pytest.raises(CheckpointError, match=_re(expected)):
            save_checkpoint(str(tmp_path), 5, [_model()])
    assert read_tracker(str(tmp_path)) is None


def _re(text):
    import re

    return re.escape(text)


def test_dcp_load_failure_becomes_a_checkpoint_error(tmp_path, monkeypatch):
    save_random_model(make_config(TINY_GPT, vocab_size=128), tmp_path, iteration=2)

    def load(*args, **kwargs):
        try:
            raise ValueError("bad chunk")
        except ValueError as e:
            raise CheckpointException("load", {1: (e, traceback.extract_tb(e.__traceback__))}) from None

    monkeypatch.setattr(dcp_io.dcp, "load", load)
    from megalm.models import GPTModel

    with pytest.raises(CheckpointError, match=r"failed to load .*iter_0000002: ValueError: bad chunk$"):
        load_checkpoint(
            str(tmp_path),
            [GPTModel(make_config(TINY_GPT, vocab_size=128), process_groups=get_process_groups())],
            finetune=True,
        )


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (needs root; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_full_disk_says_no_space_left_and_names_the_path(tiny_disk, asynchronous):
    root = str(tiny_disk / "ckpt")
    path = os.path.join(root, "iter_0000001")
    writer = AsyncCheckpointWriter() if asynchronous else None
    if asynchronous:
        save_checkpoint(root, 1, [_model()], async_writer=writer)
        with pytest.raises(AsyncSaveError) as raised:
            writer.wait()
    else:
        with pytest.raises(CheckpointError) as raised:
            save_checkpoint(root, 1, [_model()])
    message = str(raised.value)
    assert f"cannot write checkpoint {path}: No space left on device" in message, message
    assert "\n" not in message, message
    assert read_tracker(root) is None


def test_hostile_metadata_is_refused_by_the_reader_even_with_a_matching_manifest(tmp_path):
    """The manifest is a checksum, not a signature: an attacker rewrites it too.  The restricted
    reader still refuses the payload, and a payload that fails the checksum is reported as the
    security refusal (never skipped by --ckpt-fallback-to-verified)."""
    from megalm.models import GPTModel
    from tests.test_checkpoint_security import payload

    cfg = make_config(TINY_GPT, vocab_size=128)
    save_random_model(cfg, tmp_path, iteration=3)
    save_random_model(cfg, tmp_path, iteration=5)
    it = tmp_path / "iter_0000005"
    marker = tmp_path / "marker"
    (it / ".metadata").write_bytes(payload("reduce", marker))
    for fallback in (False, True):
        with pytest.raises(CheckpointError, match=f"{it}/.metadata.*refusing to unpickle"):
            load_checkpoint(
                str(tmp_path), [GPTModel(cfg, process_groups=get_process_groups())], finetune=True, fallback=fallback
            )
    checkpoint_manifest.write_rank_manifest(str(it), 0)
    checkpoint_manifest.write_index(str(it), 5, 1)
    assert verify_checkpoint(str(it), 5) is None
    with pytest.raises(CheckpointError, match=f"{it}/.metadata.*refusing to unpickle"):
        load_checkpoint(str(tmp_path), [GPTModel(cfg, process_groups=get_process_groups())], finetune=True)
    assert not marker.exists()


def test_megatron_lm_checkpoints_are_named_as_such(tmp_path):
    """A Megatron-LM --save directory (same tracker file name) fails on --load with a message naming
    Megatron-LM and its format, not "common.json is missing"."""
    import json as _json

    from megalm.checkpoint.errors import CheckpointError
    from megalm.checkpoint.resume import checkpoint_to_resume

    for name, make in (
        ("torch_dist", lambda d: (d / "metadata.json").write_text(_json.dumps({"sharded_backend": "torch_dist"}))),
        ("legacy", lambda d: ((d / "mp_rank_00").mkdir(), (d / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x"))),
    ):
        root = tmp_path / name
        (root / "iter_0000010").mkdir(parents=True)
        (root / "latest_checkpointed_iteration.txt").write_text("10")
        make(root / "iter_0000010")
        with pytest.raises(CheckpointError, match="is a Megatron-LM checkpoint .*megalm cannot load") as e:
            checkpoint_to_resume(str(root), None)
        assert f"tools/checkpoint/convert.py --from megatron --load-dir {root} --save-dir" in str(e.value)

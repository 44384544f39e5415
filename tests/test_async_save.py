"""--async-save (megalm/checkpoint/async_writer.py): the writer thread, staging, and whole trainings on 2
spawned ranks whose background writes are slowed down so that training runs ahead of them."""

import json
import os
import threading
import time

import pytest
import torch

from megalm.checkpoint.async_writer import AsyncCheckpointWriter, AsyncSaveError
from megalm.checkpoint.resume import TRACKER_FILENAME
from megalm.checkpoint.save import stage_to_cpu
from megalm.param_layout import ShardedTensorSpec
from tests.distributed_harness import run_distributed
from tests.training_runs import losses, metrics_argv, records, tiny_flags

# --- the writer -----------------------------------------------------------------------------------


def test_writer_runs_one_write_at_a_time_in_the_background():
    writer, order = AsyncCheckpointWriter(), []
    gates = {"first": threading.Event(), "second": threading.Event()}

    def slow(name):
        def write():
            gates[name].wait(timeout=10)
            order.append(name)

        return write

    writer.submit(2, slow("first"))
    assert writer.in_flight == 2 and not writer.done() and order == []  # submit returned while writing
    threading.Timer(0.2, gates["first"].set).start()
    writer.submit(4, slow("second"))  # waits for the first write
    assert order == ["first"] and writer.in_flight == 4 and not writer.done()
    gates["second"].set()
    assert writer.wait() == 4 and order == ["first", "second"]
    assert writer.wait() is None and writer.in_flight is None and writer.done()


def test_writer_failure_is_raised_by_wait_with_the_iteration():
    writer = AsyncCheckpointWriter()

    def fail():
        raise OSError("No space left on device")

    writer.submit(6, fail)
    with pytest.raises(AsyncSaveError, match="background save of iteration 6 failed: OSError: No space left"):
        writer.wait()
    assert writer.wait() is None  # reported once


def test_staging_copies_every_block():
    weight, a, b = torch.ones(4, 3), torch.zeros(2), torch.zeros(3)
    specs = {
        "w": ShardedTensorSpec(weight, (8, 3), (4, 0)),
        "opt": [ShardedTensorSpec(a, (5,), (0,)), ShardedTensorSpec(b, (5,), (2,))],
    }
    staged = stage_to_cpu(specs)
    weight.add_(1.0)  # the next optimizer step
    a.fill_(7.0)
    assert torch.equal(staged["w"].local, torch.ones(4, 3))
    assert (tuple(staged["w"].global_shape), tuple(staged["w"].offsets)) == ((8, 3), (4, 0))
    assert [s.local.tolist() for s in staged["opt"]] == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    assert [tuple(s.offsets) for s in staged["opt"]] == [(0,), (2,)]


# --- whole trainings ------------------------------------------------------------------------------

BASE = tiny_flags(
    hidden_size="32",
    seq_length="16",
    vocab_size="200",
    lr="3e-3",
    seed="5",
    micro_batch_size="2",
    global_batch_size="8",
    use_distributed_optimizer=True,
)


def _slowed_trainings(runs, delay, fail_common_on_rank=None):
    """Run each (argv, observations file) with background writes delayed by ``delay`` seconds;
    each delayed write first records what a reader of the checkpoint directory would see."""
    import torch.distributed as dist

    import megalm.checkpoint.save as ckpt
    from tests.training_runs import run_trainings

    original_save, original_common = ckpt.save_sharded, ckpt._write_common
    codes = []
    for argv, observations in runs:
        root = argv[argv.index("--save") + 1]

        def slowed_save(specs, path, process_group=None, objects=None):
            if process_group is not None:  # the background thread
                seen = {
                    "path": os.path.basename(path),
                    "tracker": open(os.path.join(root, TRACKER_FILENAME)).read()
                    if os.path.exists(os.path.join(root, TRACKER_FILENAME))
                    else None,
                    "common": os.path.exists(os.path.join(path, "common.json")),
                }
                with open(f"{observations}.rank{dist.get_rank()}", "a") as f:
                    f.write(json.dumps(seen) + "\n")
                time.sleep(delay)
            return original_save(specs, path, process_group=process_group, objects=objects)

        def failing_common(path, common):
            if dist.get_rank() == fail_common_on_rank:
                raise OSError("No space left on device")
            return original_common(path, common)

        ckpt.save_sharded, ckpt._write_common = slowed_save, failing_common
        try:
            codes += run_trainings([argv])
        finally:
            ckpt.save_sharded, ckpt._write_common = original_save, original_common
    return codes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("async_save"))

    ck = os.path.join(tmp, "ck")
    runs = [
        (
            metrics_argv(
                BASE, tmp, "async", "--train-iters", "6", "--save", ck, "--save-interval", "2", "--async-save"
            ),
            os.path.join(tmp, "async.seen"),
        ),
        (
            metrics_argv(
                BASE,
                tmp,
                "resume2",
                "--train-iters",
                "6",
                "--save",
                os.path.join(tmp, "ck_resume"),
                "--load",
                ck,
                "--ckpt-step",
                "2",
                "--async-save",
            ),
            os.path.join(tmp, "resume.seen"),
        ),
        (
            metrics_argv(
                BASE, tmp, "sync", "--train-iters", "6", "--save", os.path.join(tmp, "ck_sync"), "--save-interval", "2"
            ),
            os.path.join(tmp, "sync.seen"),
        ),
        (
            metrics_argv(
                BASE,
                tmp,
                "exit",
                "--train-iters",
                "6",
                "--save",
                os.path.join(tmp, "ck_exit"),
                "--save-interval",
                "100",
                "--exit-interval",
                "3",
                "--async-save",
            ),
            os.path.join(tmp, "exit.seen"),
        ),
    ]
    codes = run_distributed(_slowed_trainings, 2, args=(runs, 1.0), timeout=300)
    assert codes == [[0, 0, 0, 0]] * 2, codes
    return tmp


def _seen(path, rank):
    with open(f"{path}.rank{rank}") as f:
        return [json.loads(line) for line in f]


def test_training_runs_ahead_of_the_background_write(trained):
    seen = _seen(os.path.join(trained, "async.seen"), 0)
    # Each write started before the previous tracker moved on and before its own common.json.
    assert seen == [
        {"path": "iter_0000002", "tracker": None, "common": False},
        {"path": "iter_0000004", "tracker": "2", "common": False},
        {"path": "iter_0000006", "tracker": "4", "common": False},
    ]
    assert [s["path"] for s in _seen(os.path.join(trained, "async.seen"), 1)] == [s["path"] for s in seen]
    ck = os.path.join(trained, "ck")
    assert open(os.path.join(ck, TRACKER_FILENAME)).read() == "6"  # the last save completed before exit
    for it in (2, 4, 6):
        with open(os.path.join(ck, f"iter_{it:07d}", "common.json")) as f:
            assert json.load(f)["iteration"] == it


def test_async_checkpoints_hold_the_state_of_their_iteration(trained):
    # Iterations 3 and 4 ran while iteration 2's tensors were being written (1 s delay): resuming
    # from iteration 2 must reproduce them exactly, which it cannot if the write saw later weights.
    full, resumed = losses(trained, "async"), losses(trained, "resume2")
    assert len(full) == 6 and resumed == full[2:]
    assert losses(trained, "sync") == full  # the same numbers as synchronous saving
    assert [r["iteration"] for r in records(trained, "resume2")] == [3, 4, 5, 6]


def test_exit_interval_waits_for_the_background_save(trained):
    ck = os.path.join(trained, "ck_exit")
    assert [s["path"] for s in _seen(os.path.join(trained, "exit.seen"), 0)] == ["iter_0000003"]
    assert open(os.path.join(ck, TRACKER_FILENAME)).read() == "3"  # written before the process exited
    assert os.path.isfile(os.path.join(ck, "iter_0000003", "common.json"))
    assert [r["iteration"] for r in records(trained, "exit")] == [1, 2, 3]


def test_sync_saves_never_use_the_background_thread(trained):
    assert not os.path.exists(os.path.join(trained, "sync.seen.rank0"))


def test_failed_background_write_stops_every_rank_and_keeps_the_tracker(tmp_path):
    ck = str(tmp_path / "ck")
    argv = BASE + ["--train-iters", "6", "--save", ck, "--save-interval", "2", "--async-save"]
    codes = run_distributed(_slowed_trainings, 2, args=([(argv, str(tmp_path / "seen"))], 0.0, 0), timeout=240)
    failure = f"cannot write checkpoint {ck}/iter_0000002: No space left on device (OSError: No space left on device)"
    assert f"background save of iteration 2 failed: CheckpointError: {failure}" in codes[0][0]
    assert f"background save of iteration 2 failed: CheckpointError: rank 0 failed: {failure}" in codes[1][0]
    assert not os.path.exists(os.path.join(ck, TRACKER_FILENAME))  # the failed save is never resumed from
    assert not os.path.exists(os.path.join(ck, "iter_0000004"))  # nothing after the failure was started

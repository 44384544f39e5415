"""--profile (megalm/training/profiling.py): which iterations a torch.profiler trace holds, on
which ranks, read back from the trace file; and a real training on 2 spawned ranks."""

import glob
import json
import os

import pytest
import torch

from megalm.training.profiling import ProfilerUnavailable, StepProfiler
from tests.configs import make_config
from tests.distributed_harness import run_distributed
from tests.training_runs import tiny_flags


def _profiler(trace_dir, start, end, ranks=(0,), **logging) -> StepProfiler:
    """Rank 0's profiler of --profile --use-pytorch-profiler over iterations [start, end) on ``ranks``,
    traces under ``trace_dir``; ``logging``: other fields of the logging section."""
    window = dict(profile=True, use_pytorch_profiler=True, profile_step_start=start, profile_step_end=end)
    cfg = make_config(window, logging, profile_ranks=list(ranks), tensorboard_dir=str(trace_dir), validate=False)
    return StepProfiler(cfg.logging, rank=0)


def _trace(trace_dir, rank=0):
    files = glob.glob(os.path.join(str(trace_dir), f"rank{rank}.*.pt.trace.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    return (
        sorted(n for n in names if n.startswith("iteration ")),
        sorted(n for n in names if n.startswith("ProfilerStep#")),
    )


def _train(profiler, iterations, stop_early_at=None):
    """A stand-in loop: each step is a labelled matmul, with the trainer's hook calls."""
    x = torch.randn(32, 32)
    for it in range(iterations):
        if it == stop_early_at:
            break
        profiler.before_step(it)
        with torch.profiler.record_function(f"iteration {it}"):
            x = torch.tanh(x @ x)
        profiler.after_step(it + 1)
    profiler.close()


def test_window_records_steps_start_to_end_minus_one(tmp_path):
    _train(_profiler(tmp_path, 2, 4), 6)
    labels, steps = _trace(tmp_path)
    assert labels == ["iteration 2", "iteration 3"]  # iteration 1 was the discarded warm-up
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]


def test_window_from_the_first_step(tmp_path):
    _train(_profiler(tmp_path, 0, 2), 4)
    assert _trace(tmp_path)[0] == ["iteration 0", "iteration 1"]


def test_training_that_ends_inside_the_window_keeps_what_was_recorded(tmp_path):
    _train(_profiler(tmp_path, 1, 10), 10, stop_early_at=4)
    assert _trace(tmp_path)[0] == ["iteration 1", "iteration 2", "iteration 3"]


def test_ranks_not_listed_and_runs_without_profile_write_nothing(tmp_path):
    _train(_profiler(tmp_path, 0, 2, ranks=(1,)), 3)
    _train(_profiler(tmp_path, 0, 2, profile=False), 3)
    assert os.listdir(tmp_path) == []


def test_resumed_past_the_window_says_so(tmp_path):
    profiler = _profiler(tmp_path, 10, 12)
    assert profiler.note_on_resume(9) is None  # step 9 is the warm-up: the window is still ahead
    assert "--profile-step-start 10 is before the resumed iteration 11" in profiler.note_on_resume(11)
    assert _profiler(tmp_path, 10, 12, ranks=(1,)).note_on_resume(11) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the nsys path needs no error on a GPU")
def test_nsys_profiling_without_a_gpu_is_refused():
    with pytest.raises(ProfilerUnavailable, match="add --use-pytorch-profiler"):
        _profiler("unused", 0, 2, use_pytorch_profiler=False)
    _profiler("unused", 0, 2, ranks=(1,), use_pytorch_profiler=False)  # not profiled here: fine


def _pretrain(argv):
    from tests.training_runs import run_trainings

    return run_trainings([argv])


def test_training_traces_the_window_on_the_listed_rank(tmp_path):
    tb = tmp_path / "tb"
    # The tiny GPT at hidden 32 with its dropout defaults, 5 iterations traced on rank 1 only.
    shape = dict(hidden_size=32, seq_length=16, vocab_size=200, hidden_dropout=None, attention_dropout=None)
    run = dict(lr=None, seed=None, micro_batch_size=2, global_batch_size=4, train_iters=5, log_interval=5)
    window = dict(profile=True, use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_ranks=1)
    argv = tiny_flags(**shape, **run, **window, tensorboard_dir=tb, timing_log_level=2)
    assert run_distributed(_pretrain, 2, args=(argv,), timeout=240) == [[0], [0]]
    assert glob.glob(str(tb / "rank0.*")) == []
    assert _trace(tb, rank=1)[1] == ["ProfilerStep#1", "ProfilerStep#2"]
    phases = _event_names(tb, rank=1)  # the timers' ranges name the phases in the trace
    assert {
        "forward-backward",
        "forward-compute",
        "backward-compute",
        "optimizer",
        "optimizer-inner-step",
        "all-grads-sync",
        "batch-generator",
    } <= phases


def _event_names(trace_dir, rank):
    (path,) = glob.glob(os.path.join(str(trace_dir), f"rank{rank}.*.pt.trace.json"))
    with open(path) as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}

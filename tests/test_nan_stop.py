"""Non-finite losses and gradients stop the run (issue #18, item 2), on 2 real gloo ranks.

--check-for-nan-in-loss-and-grad (default on): every rank stops non-zero at the first non-finite
iteration, the message names the iteration and the rank(s) whose loss was not finite, and the
checkpoint tracker stays at the last finite iteration; --no-check-for-nan-in-loss-and-grad skips
and goes on; fp16 stops after --max-overflows-at-min-loss-scale overflows at the minimum scale;
--check-for-spiky-loss warns (or stops) on an injected spike and stays quiet otherwise.
"""

import copy
import logging
import math
import os

import pytest

from megalm.config import ConfigError
from tests.distributed_harness import run_distributed
from tests.training_runs import metrics_argv, records, tiny_flags

TINY = tiny_flags(
    lr=None,
    min_lr="1e-4",
    lr_decay_style="cosine",
    lr_warmup_iters="2",
    clip_grad="1.0",
    split="100,0,0",
    micro_batch_size="4",
    global_batch_size="8",
)
# The runs' learning rate (a run that diverges raises it with a later --lr).
RUN = TINY + ["--lr", "2e-3"]


def scaled_at(forward_step, calls, factor, rank=None):
    """Wrap ``forward_step``: the per-token losses of the given microbatch calls (1-based, counted
    on this rank) are multiplied by ``factor``, on ``rank`` only when given."""
    import torch.distributed as dist

    count = {"n": 0}
    mine = rank is None or dist.get_rank() == rank

    def step(data_iterator, model):
        count["n"] += 1
        out, loss_func = forward_step(data_iterator, model)
        return (out * factor if mine and count["n"] in calls else out), loss_func

    return step


def nan_grads_at(forward_step, calls, rank):
    """Wrap ``forward_step``: on ``rank``, the backward of the given microbatch calls turns NaN
    (its loss stays finite), as a bad kernel on one rank would."""
    import torch.distributed as dist

    count = {"n": 0}

    def step(data_iterator, model):
        count["n"] += 1
        out, loss_func = forward_step(data_iterator, model)
        if dist.get_rank() == rank and count["n"] in calls:
            out.register_hook(lambda g: g * float("nan"))
        return out, loss_func

    return step


def _run_all(runs):
    """Each ``(argv, hook)`` through ``pretrain_gpt.main`` on this rank; ``hook``: None or
    ``(calls, factor, rank)`` for :func:`scaled_at`.  Returns ``(exit code or message, warnings
    of megalm.training.loss_checks)`` per run."""
    import pretrain_gpt
    from megalm import parallel_state

    seen = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(f"{record.levelname}: {record.getMessage()}")

    logging.getLogger("megalm.training.loss_checks").addHandler(Capture())
    out = []
    for argv, hook in runs:
        del seen[:]
        if hook is None:
            step = pretrain_gpt.forward_step
        elif hook[0] == "nan_grads":
            step = nan_grads_at(pretrain_gpt.forward_step, *hook[1:])
        else:
            step = scaled_at(pretrain_gpt.forward_step, *hook)
        try:
            pretrain_gpt.main(argv, step)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else str(e.code)
        parallel_state.destroy_model_parallel()
        out.append((code, list(seen)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("nanstop"))

    def ck(name):
        return os.path.join(tmp, f"ckpt_{name}")

    inf, every = float("inf"), set(range(3, 100))
    todo = {
        "lr": (
            metrics_argv(
                RUN, tmp, "lr", "--lr", "1e10", "--train-iters", "6", "--save", ck("lr"), "--save-interval", "1"
            ),
            None,
        ),
        "rank1": (
            metrics_argv(RUN, tmp, "rank1", "--train-iters", "6", "--save", ck("rank1"), "--save-interval", "2"),
            ({3}, inf, 1),
        ),
        "grads1": (metrics_argv(RUN, tmp, "grads1", "--train-iters", "5"), ("nan_grads", {3}, 1)),
        "nocheck": (
            metrics_argv(
                RUN, tmp, "nocheck", "--lr", "1e10", "--train-iters", "5", "--no-check-for-nan-in-loss-and-grad"
            ),
            None,
        ),
        "fp16": (
            metrics_argv(
                RUN,
                tmp,
                "fp16",
                "--train-iters",
                "10",
                "--fp16",
                "--initial-loss-scale",
                "1",
                "--min-loss-scale",
                "1",
                "--hysteresis",
                "1",
                "--max-overflows-at-min-loss-scale",
                "3",
                "--save",
                ck("fp16"),
                "--save-interval",
                "1",
            ),
            (every, inf, None),
        ),
        "spike": (metrics_argv(RUN, tmp, "spike", "--train-iters", "6", "--check-for-spiky-loss"), ({4}, 1000.0, 0)),
        "spike_stop": (
            metrics_argv(
                RUN,
                tmp,
                "spike_stop",
                "--train-iters",
                "6",
                "--check-for-spiky-loss",
                "--spiky-loss-action",
                "stop",
                "--save",
                ck("spike_stop"),
                "--save-interval",
                "1",
            ),
            ({4}, 1000.0, 0),
        ),
        "normal": (metrics_argv(RUN, tmp, "normal", "--train-iters", "6", "--check-for-spiky-loss"), None),
    }
    names = list(todo)
    by_rank = run_distributed(_run_all, 2, args=([todo[n] for n in names],), timeout=400)
    return {"tmp": tmp, "ck": ck, "out": {n: [by_rank[r][i] for r in range(2)] for i, n in enumerate(names)}}


def _codes(runs, name):
    return [code for code, _ in runs["out"][name]]


def _tracker(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read().strip())


def _iteration_dirs(root):
    return sorted(int(d[len("iter_") :]) for d in os.listdir(root) if d.startswith("iter_"))


def test_huge_lr_stops_every_rank_at_the_first_nonfinite_iteration(runs):
    codes = _codes(runs, "lr")
    assert all(isinstance(c, str) for c in codes), codes
    # lr warms up from 0: iteration 2 takes a 1e10-sized step, iteration 3 is the first non-finite one.
    for c in codes:
        assert c.startswith("error: non-finite loss at iteration 3 on ranks 0, 1"), c
        assert "last checkpoint saved by this run: iteration 2" in c
    assert codes[0] == codes[1]
    root = runs["ck"]("lr")
    assert _tracker(root) == 2
    assert _iteration_dirs(root) == [1, 2]
    assert [r["iteration"] for r in records(runs["tmp"], "lr")] == [1, 2]
    assert all(math.isfinite(r["lm_loss"]) and math.isfinite(r["grad_norm"]) for r in records(runs["tmp"], "lr"))


def test_nonfinite_loss_on_one_rank_names_that_rank(runs):
    codes = _codes(runs, "rank1")
    for c in codes:
        assert isinstance(c, str) and c.startswith("error: non-finite loss at iteration 3 on rank 1 "), c
        assert "ranks" not in c.split(" (")[0]
    root = runs["ck"]("rank1")
    assert _tracker(root) == 2
    assert _iteration_dirs(root) == [2]


def test_nonfinite_gradients_on_one_rank_name_that_rank(runs):
    """A finite loss whose backward is NaN on rank 1 only: the stop names rank 1 as the origin (each rank
    checks its own gradients before the data-parallel reduction)."""
    for c in _codes(runs, "grads1"):
        assert isinstance(c, str) and c.startswith("error: non-finite gradient norm (nan) at iteration 3"), c
        assert "the gradients were not finite on rank 1 before the data-parallel reduction" in c, c


def test_no_check_flag_restores_skipping(runs):
    assert _codes(runs, "nocheck") == [0, 0]
    recs = records(runs["tmp"], "nocheck")
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["nan_iterations"] for r in recs] == [0, 0, 1, 1, 1]
    assert [r["skipped_iterations"] for r in recs] == [0, 0, 1, 1, 1]


def test_fp16_stops_after_k_overflows_at_the_minimum_scale(runs):
    codes = _codes(runs, "fp16")
    for c in codes:
        assert isinstance(c, str) and c.startswith(
            "error: fp16: the last 3 iterations (through iteration 5) overflowed at the minimum loss scale 1"
        ), c
        assert "--max-overflows-at-min-loss-scale 3" in c
    recs = records(runs["tmp"], "fp16")
    assert [r["skipped_iterations"] for r in recs] == [0, 0, 1, 1]  # iteration 5 stopped before its log line
    root = runs["ck"]("fp16")
    assert _tracker(root) == 4
    assert _iteration_dirs(root) == [1, 2, 3, 4]


def test_spiky_loss_warns_on_the_spike_only(runs):
    assert _codes(runs, "spike") == [0, 0]
    rank0, rank1 = (w for _, w in runs["out"]["spike"])
    assert rank0 == []  # warned once, on the last rank
    assert len(rank1) == 1 and rank1[0].startswith("WARNING: spiky loss at iteration 4: lm loss "), rank1
    assert "> 10 x the running mean" in rank1[0] and "previous 3 iteration(s)" in rank1[0]
    loss = {r["iteration"]: r["lm_loss"] for r in records(runs["tmp"], "spike")}
    assert loss[4] > 10 * (loss[1] + loss[2] + loss[3]) / 3


def test_spiky_loss_stop_keeps_the_tracker_before_the_spike(runs):
    for c in _codes(runs, "spike_stop"):
        assert isinstance(c, str) and c.startswith("error: spiky loss at iteration 4:"), c
        assert "--spiky-loss-action stop" in c
    assert _tracker(runs["ck"]("spike_stop")) == 3
    assert _iteration_dirs(runs["ck"]("spike_stop")) == [1, 2, 3]


def test_normal_run_has_no_spike_warning(runs):
    assert [out for out in runs["out"]["normal"]] == [(0, []), (0, [])]
    assert len(records(runs["tmp"], "normal")) == 6


# --- single process ------------------------------------------------------------------------------


def test_flags_and_defaults():
    from megalm.config import parse_config

    cfg = parse_config(TINY + ["--lr", "1e-3", "--train-iters", "4"], world_size=1)
    assert cfg.training.check_for_nan_in_loss_and_grad is True
    assert cfg.training.check_for_spiky_loss is False
    assert cfg.training.max_overflows_at_min_loss_scale == 10
    off = parse_config(TINY + ["--train-iters", "4", "--no-check-for-nan-in-loss-and-grad"], world_size=1)
    assert off.training.check_for_nan_in_loss_and_grad is False


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("spiky_loss_action", "rollback", "--spiky-loss-action rollback .* is not built"),
        ("spiky_loss_factor", 1.0, "--spiky-loss-factor must be > 1"),
        ("spiky_loss_window", 0, "--spiky-loss-window must be >= 1"),
        ("max_overflows_at_min_loss_scale", -1, "--max-overflows-at-min-loss-scale must be >= 0"),
    ],
)
def test_bad_values_are_refused(field, value, message):
    from megalm.config import parse_config
    from megalm.config.sections import ConfigError
    from megalm.config.validation import validate_config

    cfg = parse_config(TINY + ["--lr", "1e-3", "--train-iters", "4", "--check-for-spiky-loss"], world_size=1)
    cfg = copy.deepcopy(cfg)  # an editable copy: the validated config is frozen
    setattr(cfg.training, field, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, world_size=1)


def test_rollback_refused_on_the_command_line(capsys):
    from megalm.config import parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(
            TINY + ["--train-iters", "4", "--check-for-spiky-loss", "--spiky-loss-action", "rollback"], world_size=1
        )
    assert "--spiky-loss-action rollback (reload the last checkpoint and skip the batch) is not built" in str(e.value)


def test_overflow_count_at_min_scale():
    from megalm.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    s = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, hysteresis=1, growth_interval=1000)
    counts = []
    for found_inf in [True, True, True, True, False, True, True]:  # scales used: 4 2 1 1 1 1 1
        s.update(found_inf)
        counts.append(s.overflows_at_min_scale)
    assert counts == [0, 0, 1, 2, 0, 1, 2]
    c = ConstantGradScaler(8.0)
    for found_inf in [True, True]:
        c.update(found_inf)
    assert c.overflows_at_min_scale == 2
    c.update(False)
    assert c.overflows_at_min_scale == 0


def test_spiky_loss_detector():
    from megalm.training.loss_checks import SpikyLossDetector

    d = SpikyLossDetector(factor=10.0, window=2)
    assert d.spike(1, 5.0) is None and d.spike(2, 3.0) is None
    assert d.spike(3, 39.0) is None  # 39 < 10 x 4
    assert d.spike(4, 300.0).startswith(
        "spiky loss at iteration 4: lm loss 3.000000E+02 > 10 x the running mean "
        "2.100000E+01 of the previous 2 iteration(s)"
    )
    assert list(d.history) == [3.0, 39.0]  # the spike stays out of the mean

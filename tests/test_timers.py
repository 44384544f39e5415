"""Megatron's per-phase timers (megalm/timers.py): the timer arithmetic with an injected clock,
the log block's exact text, and whole trainings on spawned ranks (pipeline, data parallel with
the distributed optimizer) whose timing blocks, TensorBoard scalars and metrics agree, and whose
losses are the same with timers on and off."""

import contextlib
import os
import re

import pytest
import torch

from megalm.config import ConfigError, parse_config
from megalm.timers import (
    ITERATION_TIMERS,
    NULL_TIMER,
    TIMER_LEVELS,
    Timer,
    TimerError,
    Timers,
    format_times,
    timed_iterator,
)
from tests.distributed_harness import run_distributed
from tests.training_runs import losses, metrics_argv, records, tiny_flags


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _timers(level, clock=None, syncs=None, **kw):
    sync = (lambda: syncs.append(1)) if syncs is not None else (lambda: None)
    return Timers(level, clock=clock or FakeClock(), synchronize_device=sync, **kw)


# --- one timer ------------------------------------------------------------------------------------


def test_timer_accumulates_between_start_and_stop():
    clock, syncs = FakeClock(), []
    t = Timer("x", clock, lambda: syncs.append(1))
    t.start()
    clock.now = 1.5
    t.stop()
    clock.now = 10.0  # not running: not counted
    t.start()
    clock.now = 10.25
    t.stop()
    assert t.elapsed(reset=False) == 1.75
    assert t.elapsed() == 1.75
    assert t.elapsed() == 0.0  # reset by the previous call
    assert len(syncs) == 4  # the device is synchronized at every start and stop


def test_running_timer_counts_up_to_now_and_keeps_running():
    clock = FakeClock()
    t = Timer("x", clock, lambda: None)
    t.start()
    clock.now = 2.0
    assert t.elapsed() == 2.0
    clock.now = 3.0
    t.stop()
    assert t.elapsed() == 1.0  # counted from the reset, not from the start


def test_misuse_is_named():
    t = Timer("forward-compute", FakeClock(), lambda: None)
    with pytest.raises(TimerError, match="'forward-compute' was stopped without start"):
        t.stop()
    t.start()
    with pytest.raises(TimerError, match="'forward-compute' was started twice"):
        t.start()


def test_context_manager_stops_on_exception():
    clock = FakeClock()
    t = Timer("x", clock, lambda: None)
    with pytest.raises(KeyError):
        with t:
            clock.now = 0.5
            raise KeyError("boom")
    assert not t.running and t.elapsed() == 0.5


# --- levels ---------------------------------------------------------------------------------------


def test_timers_above_the_level_are_null_and_cost_nothing():
    syncs = []
    t0 = _timers(0, syncs=syncs)
    assert t0("forward-backward") is NULL_TIMER and t0("forward-compute") is NULL_TIMER
    with t0("optimizer"):
        pass
    assert syncs == []
    assert isinstance(t0("save-checkpoint"), Timer)
    t1 = _timers(1)
    assert isinstance(t1("forward-backward"), Timer) and t1("forward-compute") is NULL_TIMER
    t2 = _timers(2)
    assert all(isinstance(t2(name), Timer) for name in TIMER_LEVELS)
    assert t2("forward-backward") is t2("forward-backward")  # one timer per name


def test_level_one_timers_start_with_a_barrier_unless_disabled():
    on, off = _timers(2), _timers(2, barrier_with_level_1=False)
    assert on("optimizer").barrier_on_start and not on("forward-compute").barrier_on_start
    assert not on("save-checkpoint").barrier_on_start
    assert not off("optimizer").barrier_on_start


def test_bad_timer_arguments():
    with pytest.raises(ValueError, match="has no level"):
        _timers(2)("my-phase")
    assert isinstance(_timers(2)("my-phase", log_level=2), Timer)
    with pytest.raises(ValueError, match="0, 1 or 2"):
        Timers(3)
    with pytest.raises(ValueError, match="timing log option"):
        Timers(1, "median")


def test_single_process_log_and_max_seconds():
    clock = FakeClock()
    timers = _timers(1, clock)
    for _ in range(4):  # four iterations of 30 ms forward-backward
        with timers("forward-backward"):
            clock.now += 0.030
    block, slowest = timers.report(ITERATION_TIMERS, 4)
    assert slowest == {"forward-backward-time": pytest.approx(0.030)}
    assert block == (
        "(min, max) time across ranks (ms):\n    forward-backward ...............................: (30.00, 30.00)"
    )
    assert timers.log(ITERATION_TIMERS, 4) is None  # reset by the previous log


# --- the block's text -----------------------------------------------------------------------------

TIMES = torch.tensor(
    [[0.010, 0.0, 0.002], [0.030, 0.0, 0.0]], dtype=torch.float64
)  # [rank, name] seconds; 0: did not run


def test_minmax_block_skips_ranks_and_timers_that_did_not_run():
    assert format_times(["a", "b", "c"], TIMES, 2.0, "minmax") == (
        "(min, max) time across ranks (ms):\n"
        "    a ..............................................: (5.00, 15.00)\n"
        "    c ..............................................: (1.00, 1.00)"
    )


def test_max_and_all_blocks():
    assert format_times(["a", "b", "c"], TIMES, 1.0, "max") == (
        "max time across ranks (ms):\n"
        "    a ..............................................: 30.00\n"
        "    c ..............................................: 2.00"
    )
    assert format_times(["a", "b", "c"], TIMES, 1.0, "all") == (
        "times across ranks (ms):\n    a:\n     rank  0: 10.00\n     rank  1: 30.00\n    c:\n     rank  0: 2.00"
    )
    assert format_times(["b"], TIMES[:, 1:2], 1.0, "minmax") is None


# --- data iterator --------------------------------------------------------------------------------


def test_timed_iterator_times_next_and_passes_items_through():
    clock = FakeClock()
    timers = _timers(2, clock)

    def slow():
        for item in ("a", "b"):
            clock.now += 0.25
            yield item

    timed = timed_iterator(slow(), timers("batch-generator"))
    assert list(timed) == ["a", "b"]  # StopIteration passes through and stops the timer
    assert timers("batch-generator").elapsed() == 0.5
    source = iter([1])
    assert timed_iterator(source, _timers(1)("batch-generator")) is source  # level 1: untouched
    assert timed_iterator(None, timers("batch-generator")) is None
    wrapped = timed_iterator([iter([1]), None], timers("batch-generator"))
    assert next(wrapped[0]) == 1 and wrapped[1] is None


# --- flags ----------------------------------------------------------------------------------------


def test_timing_flags_parse_and_bad_values_fail():
    cfg = parse_config(
        [
            "--mock-data",
            "--vocab-size",
            "64",
            "--timing-log-level",
            "2",
            "--timing-log-option",
            "max",
            "--log-timers-to-tensorboard",
            "--no-barrier-with-level-1-timing",
        ]
    )
    lg = cfg.logging
    assert (
        lg.timing_log_level,
        lg.timing_log_option,
        lg.log_timers_to_tensorboard,
        lg.barrier_with_level_1_timing,
    ) == (2, "max", True, False)
    defaults = parse_config(["--mock-data", "--vocab-size", "64"]).logging
    assert (defaults.timing_log_level, defaults.timing_log_option, defaults.barrier_with_level_1_timing) == (
        0,
        "minmax",
        True,
    )
    for bad in (["--timing-log-level", "3"], ["--timing-log-option", "median"]):
        with pytest.raises((SystemExit, ConfigError)):
            parse_config(["--mock-data", "--vocab-size", "64", *bad])


# --- whole trainings ------------------------------------------------------------------------------

BASE = tiny_flags(
    num_layers="4",
    hidden_size="32",
    seq_length="16",
    vocab_size="200",
    lr="1e-3",
    seed="3",
    micro_batch_size="2",
    global_batch_size="8",
    train_iters="4",
    log_interval="2",
)
PP2 = ["--pipeline-model-parallel-size", "2"]


def _capturing_trainings(runs, out_dir):
    """Each run's stdout of this rank goes to ``<out_dir>/<name>.rank<r>.log``."""
    import torch.distributed as dist

    from tests.training_runs import run_trainings

    codes = []
    for name, argv in runs:
        path = os.path.join(out_dir, f"{name}.rank{dist.get_rank()}.log")
        with open(path, "w") as f, contextlib.redirect_stdout(f):
            codes += run_trainings([argv])
    return codes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("timers"))

    runs = [
        (
            "pp2_level2",
            metrics_argv(
                BASE,
                tmp,
                "pp2_level2",
                *PP2,
                "--timing-log-level",
                "2",
                "--log-timers-to-tensorboard",
                "--log-memory-to-tensorboard",
                "--log-world-size-to-tensorboard",
                "--log-validation-ppl-to-tensorboard",
                "--tensorboard-dir",
                os.path.join(tmp, "tb"),
                "--save",
                os.path.join(tmp, "ck"),
                "--save-interval",
                "4",
            ),
        ),
        ("pp2_level0", metrics_argv(BASE, tmp, "pp2_level0", *PP2)),
        (
            "dp2_distopt_max",
            metrics_argv(
                BASE,
                tmp,
                "dp2_distopt_max",
                "--use-distributed-optimizer",
                "--overlap-param-gather",
                "--overlap-grad-reduce",
                "--timing-log-level",
                "1",
                "--timing-log-option",
                "max",
            ),
        ),
        (
            "pp2_all",
            metrics_argv(
                BASE,
                tmp,
                "pp2_all",
                *PP2,
                "--timing-log-level",
                "1",
                "--timing-log-option",
                "all",
                "--no-barrier-with-level-1-timing",
            ),
        ),
    ]
    codes = run_distributed(_capturing_trainings, 2, args=(runs, tmp), timeout=300)
    assert codes == [[0] * len(runs)] * 2, codes
    return tmp


def _log(tmp, name, rank):
    with open(os.path.join(tmp, f"{name}.rank{rank}.log")) as f:
        return f.read()


def _blocks(text, header="(min, max) time across ranks (ms):"):
    """Each timing block after an iteration line: {name: (min, max)} (or {name: max})."""
    blocks = []
    for chunk in text.split(header)[1:]:
        values = {}
        for line in chunk.splitlines()[1:]:
            m = re.match(r"    (\S+) \.+: (?:\(([\d.]+), ([\d.]+)\)|([\d.]+))$", line)
            if not m:
                break
            values[m.group(1)] = (float(m.group(2)), float(m.group(3))) if m.group(2) else float(m.group(4))
        blocks.append(values)
    return blocks


def test_level_2_pipeline_blocks(trained):
    text = _log(trained, "pp2_level2", 1)  # the last rank prints
    blocks = _blocks(text)
    setup, per_interval, save = blocks[0], blocks[1:3], blocks[3]
    assert set(setup) == {"model-and-optimizer-setup", "train/valid/test-data-iterators-setup"}
    assert set(save) == {"save-checkpoint"}
    assert len(blocks) == 4
    for block in per_interval:
        expected = {
            "forward-backward",
            "all-grads-sync",
            "embedding-grads-all-reduce",
            "optimizer",
            "optimizer-copy-to-main-grad",
            "optimizer-clip-main-grad",
            "optimizer-inner-step",
            "batch-generator",
            "forward-compute",
            "backward-compute",
            "forward-recv",
            "forward-send",
            "backward-recv",
            "backward-send",
            "forward-send-backward-recv",
            "backward-send-forward-recv",
        }
        assert expected <= set(block), expected - set(block)
        assert "params-all-gather" not in block  # no distributed optimizer
        assert all(lo <= hi for lo, hi in block.values())
        # Only one of the two stages receives activations / sends gradients: min = max.
        for one_stage in ("forward-recv", "backward-send", "forward-send", "backward-recv"):
            assert block[one_stage][0] == block[one_stage][1]
        # Nested phases cannot take longer than their enclosing phase on any rank.
        assert block["forward-compute"][1] <= block["forward-backward"][1]
        assert block["backward-compute"][1] <= block["forward-backward"][1]
        assert block["optimizer-inner-step"][1] <= block["optimizer"][1]
    assert "time across ranks" not in _log(trained, "pp2_level2", 0)  # only the last rank prints


def test_level_2_writers_get_the_slowest_rank_per_iteration(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    blocks = _blocks(_log(trained, "pp2_level2", 1))[1:3]
    rows = records(trained, "pp2_level2")
    assert [r["iteration"] for r in rows] == [2, 4]
    for row, block in zip(rows, blocks):
        timed = {k[: -len("-time")]: v for k, v in row.items() if k.endswith("-time")}
        assert set(timed) == set(block)
        for name, seconds in timed.items():
            assert abs(seconds * 1000.0 - block[name][1]) <= 0.006, name  # printed to 0.01 ms
    acc = EventAccumulator(os.path.join(trained, "tb"))
    acc.Reload()
    written = [e.value for e in acc.Scalars("forward-backward-time")]
    assert written == pytest.approx([r["forward-backward-time"] for r in rows], rel=1e-6)


def test_memory_and_world_size_go_to_the_writers_only(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = records(trained, "pp2_level2")
    rss = [r["mem-max-rss-bytes"] for r in rows]
    assert [r["world-size"] for r in rows] == [2, 2]
    assert 50 * 2**20 < rss[0] <= rss[1] < 8 * 2**30  # the process's peak RSS: positive, never decreasing
    report = re.search(r"memory per rank \(peak RSS, MB\): rank 0: \d+, rank 1: (\d+)", _log(trained, "pp2_level2", 0))
    assert abs(int(report.group(1)) - rss[0] / 2**20) <= 2  # the report printed at the same log line
    acc = EventAccumulator(os.path.join(trained, "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("world-size")] == [2.0, 2.0]
    assert [e.value for e in acc.Scalars("mem-max-rss-bytes")] == pytest.approx(rss)
    # The training log line through megalm.log: "[megalm rank 1]" + Megatron's " iteration ..." text.
    line = [ln for ln in _log(trained, "pp2_level2", 1).splitlines() if ln.startswith("[megalm rank 1]  iteration")][0]
    assert "mem" not in line and "world" not in line  # not printed as losses


def test_timers_do_not_change_the_numbers(trained):
    with_timers, without = losses(trained, "pp2_level2"), losses(trained, "pp2_level0")
    assert len(with_timers) == 2 and with_timers == without  # bitwise: timers only observe
    text = _log(trained, "pp2_level0", 1)
    assert len(_blocks(text)) == 1 and "forward-backward" not in text  # level 0: set-up only
    assert not any(k.endswith("-time") for r in records(trained, "pp2_level0") for k in r)


def test_level_1_max_with_distributed_optimizer(trained):
    text = _log(trained, "dp2_distopt_max", 1)
    blocks = _blocks(text, header="max time across ranks (ms):")
    assert len(blocks) == 3  # set-up and two intervals
    for block in blocks[1:]:
        assert {"forward-backward", "all-grads-sync", "optimizer", "params-all-gather", "optimizer-inner-step"} <= set(
            block
        )
        assert not {"forward-compute", "batch-generator", "forward-recv"} & set(block)  # level 2
        assert all(isinstance(v, float) and v >= 0 for v in block.values())


def test_all_option_lists_every_rank(trained):
    text = _log(trained, "pp2_all", 1)
    interval = text.split("times across ranks (ms):")[2]
    assert re.search(r"    forward-backward:\n     rank  0: [\d.]+\n     rank  1: [\d.]+\n", interval)
    assert re.search(r"    embedding-grads-all-reduce:\n     rank  0: [\d.]+\n     rank  1: [\d.]+\n", interval)
    assert losses(trained, "pp2_all") == losses(trained, "pp2_level0")  # no barrier: same numbers

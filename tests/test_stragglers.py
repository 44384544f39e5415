"""Stragglers are named (issue #18, item 6): --log-straggler on 2 real gloo ranks, one of them
slowed by a sleep in its forward step, and the report's control port."""

import socket
import time
from types import SimpleNamespace

from megalm.testing import run_distributed
from megalm.timers import Timers
from megalm.training.stragglers import RankTime, StragglerReport, format_stragglers, slowest_and_fastest
from tests.test_nan_stop import TINY
from tests.training_runs import records

SLEEP = 0.05  # seconds added to each forward step of the slow rank


def slow_forward(forward_step, seconds):
    """Wrap ``forward_step``: each call first sleeps ``seconds`` (a slow rank)."""

    def step(data_iterator, model):
        time.sleep(seconds)
        return forward_step(data_iterator, model)

    return step


def _train_with_slow_rank(argv, slow_rank):
    import torch.distributed as dist

    import pretrain_gpt
    from megalm import parallel_state

    step = pretrain_gpt.forward_step
    if dist.get_rank() == slow_rank:
        step = slow_forward(step, SLEEP)
    pretrain_gpt.main(argv, step)
    parallel_state.destroy_model_parallel()


def test_a_rank_slowed_by_a_sleep_is_named_slowest_by_compute_time(tmp_path):
    metrics = str(tmp_path / "s.jsonl")
    argv = TINY + ["--lr", "1e-3", "--train-iters", "6", "--log-interval", "3", "--metrics-file", metrics]
    argv += ["--log-straggler", "--straggler-minmax-count", "2", "--straggler-ctrlr-port", "0"]
    run_distributed(_train_with_slow_rank, 2, args=(argv, 1), timeout=240)
    rows = records(str(tmp_path), "s")
    assert [r["iteration"] for r in rows] == [3, 6]
    host = socket.gethostname()
    for r in rows:
        slowest, fastest = r["straggler_compute_slowest"], r["straggler_compute_fastest"]
        assert [t["rank"] for t in slowest] == [1, 0] and [t["rank"] for t in fastest] == [0, 1], r
        assert {t["host"] for t in slowest} == {host} and "node" not in slowest[0]  # one node: no node index
        # 4 samples of micro batch 4 per rank and iteration: one forward step, one sleep, per iteration.
        assert slowest[0]["ms"] - fastest[0]["ms"] >= SLEEP * 1000 * 0.9, r
        step = r["straggler_step_slowest"]
        assert sorted(t["rank"] for t in step) == [0, 1] and step[0]["ms"] >= SLEEP * 1000, r  # both wait for it
        assert step[0]["ms"] >= slowest[0]["ms"] * 0.9


def _toggle(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.recv(200).decode()


def test_report_format_order_and_the_control_port_toggle():
    times = [RankTime(r, ms, "h", r // 2) for r, ms in enumerate([5.0, 9.0, 1.0, 9.0])]
    ends = slowest_and_fastest(times, 2)
    assert [t.rank for t in ends["slowest"]] == [3, 1] and [t.rank for t in ends["fastest"]] == [2, 0]
    line = format_stragglers({"step": ends, "compute": ends})
    assert "slowest step (ms): rank 3 (node 1, h) 9.0, rank 1 (node 0, h) 9.0 | fastest step (ms): rank 2" in line

    cfg = SimpleNamespace(straggler_minmax_count=1, disable_straggler_on_startup=True, straggler_ctrlr_port=0)
    report = StragglerReport(cfg, ranks_per_node=1)
    try:
        timers = Timers(always_on=("forward-compute", "backward-compute"))
        with timers("forward-compute"):
            time.sleep(0.01)
        assert report.gather(1.0, 2, timers) is None  # off on startup
        assert "straggler report on" in _toggle(report.server.server_address[1])
        with timers("backward-compute"):
            time.sleep(0.01)
        out = report.gather(1.0, 2, timers)
        (only,) = out["step"]["slowest"]
        assert only.rank == 0 and only.ms == 500.0 and only.node is None
        # The first interval's forward time was reset by the gather that was off; this one's backward counts.
        assert 5.0 <= out["compute"]["fastest"][0].ms < 500.0
        assert "straggler report off" in _toggle(report.server.server_address[1])
        assert report.gather(1.0, 1, timers) is None
    finally:
        report.close()


def test_bad_straggler_flags_are_refused_naming_the_flag():
    from megalm.config import ConfigError, build_parser, config_from_args, validate_config

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    for extra, message in [
        (["--straggler-minmax-count", "0"], "--straggler-minmax-count must be positive, got 0"),
        (["--straggler-ctrlr-port", "70000"], "--straggler-ctrlr-port must be a TCP port (0-65535), got 70000"),
    ]:
        try:
            validate_config(config_from_args(build_parser().parse_args(base + ["--log-straggler"] + extra)))
        except ConfigError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{extra} accepted")

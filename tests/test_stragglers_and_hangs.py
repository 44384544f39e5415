"""Stragglers and hangs are named (issue #18, item 6), on 2 real gloo ranks (one spawned group):

* --log-straggler: a rank slowed by a sleep in its forward step is named slowest by compute time;
* a rank that blocks in its forward step longer than --distributed-timeout-minutes: the other
  rank's error names the data-parallel group, its ranks and the rank that did not arrive, and
  --hang-watchdog-seconds dumps both ranks' stacks first (the blocked one in its forward step,
  the waiting one in the gradient all-reduce).
"""

import os
import re
import socket
import time
from types import SimpleNamespace

import pytest

from megalm.timers import Timers
from megalm.training.stragglers import RankTime, StragglerReport, format_stragglers, slowest_and_fastest
from tests.configs import MODEL_FLAGS
from tests.distributed_harness import run_distributed
from tests.test_nan_stop import TINY
from tests.training_runs import records

NO_COMPILE = ["--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-norm-fusion"]
SLEEP = 0.05  # seconds added to each forward step of the slow rank
TIMEOUT_MIN, WATCHDOG_S, BLOCK_S = 0.1, 2.5, 10.0  # 6 s collective timeout; the blocked rank sleeps 10 s


def slow_forward(forward_step, seconds):
    """Wrap ``forward_step``: each call first sleeps ``seconds`` (a slow rank)."""

    def sleeping_forward_step(data_iterator, model):
        time.sleep(seconds)
        return forward_step(data_iterator, model)

    return sleeping_forward_step


def blocked_at(forward_step, call, seconds):
    """Wrap ``forward_step``: its ``call``-th call blocks for ``seconds`` (a hung rank)."""
    calls = {"n": 0}

    def stuck_in_forward_step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == call:
            time.sleep(seconds)
        return forward_step(data_iterator, model)

    return stuck_in_forward_step


def _fresh_world():
    """Replace the harness's world group (its timeout is >= 30 s) by megalm's own: the next
    ``pretrain`` initializes torch.distributed with --distributed-timeout-minutes."""
    import torch
    import torch.distributed as dist

    from tests.distributed_harness import free_port

    port = torch.tensor([free_port() if dist.get_rank() == 0 else 0])
    dist.broadcast(port, 0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(int(port))


def _runs(straggler_argv, hang_argv, watchdog_dir):
    """On this rank: the straggler run (rank 1 slow), then the hang run (rank 1 blocked in its 4th
    forward step).  Returns the hang run's exit message and this rank's watchdog file."""
    import torch.distributed as dist

    import pretrain_gpt
    from megalm import parallel_state

    rank = dist.get_rank()
    step = pretrain_gpt.forward_step
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # the straggler run sees 2 nodes of 1 rank: the report names nodes
    pretrain_gpt.main(straggler_argv, slow_forward(step, SLEEP) if rank == 1 else step)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    parallel_state.destroy_model_parallel()
    named = _named_failure_of_a_subgroup()
    _fresh_world()
    try:
        pretrain_gpt.main(hang_argv, blocked_at(step, 4, BLOCK_S) if rank == 1 else step)
        code = 0
    except SystemExit as e:
        code = str(e.code)
    parallel_state.destroy_model_parallel()
    with open(os.path.join(watchdog_dir, f"rank_{rank}.txt")) as f:
        return code, f.read(), named


def _named_failure_of_a_subgroup():
    """Errors raised by a collective over the group ``[1]`` (held as the ``dp``, ``dp_cp`` and ``pp``
    fields of a ProcessGroups) and by an exchange with rank 1 in it: their messages, without the
    store check (collective: every rank creates the group)."""
    import torch
    import torch.distributed as dist

    from megalm.distributed.collective_errors import describe_failure
    from megalm.parallel_state import ProcessGroups

    group = dist.new_group([1])
    if dist.get_rank() != 1:
        return None

    def all_reduce(tensor, group=None):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 90000ms for recv")

    def exchange(ops):  # a pipeline exchange's wait: the group and peer come from its P2POps
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")

    groups = ProcessGroups(dp=group, dp_cp=group, pp=group)
    messages = []
    for fn, arg in [(lambda: all_reduce(None, group=group), None), (exchange, torch.zeros(1))]:
        try:
            fn() if arg is None else fn([dist.P2POp(dist.isend, arg, 1, group)])
        except RuntimeError as e:
            messages.append(describe_failure(e, groups, 90.0, check_store=False))
    return messages


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stragglers")
    base = TINY + NO_COMPILE + ["--lr", "1e-3", "--device-peak-flops", "1e12"]  # no start-up matmul measurement
    straggler = base + ["--train-iters", "6", "--log-interval", "3", "--metrics-file", str(tmp / "s.jsonl")]
    straggler += ["--log-straggler", "--straggler-minmax-count", "2", "--straggler-ctrlr-port", "0"]
    hang = base + ["--train-iters", "6", "--distributed-timeout-minutes", str(TIMEOUT_MIN)]
    hang += ["--hang-watchdog-seconds", str(WATCHDOG_S), "--save", str(tmp / "ckpt")]
    hang += ["--no-check-for-nan-in-loss-and-grad"]  # the first collective after the backward: the gradient all-reduce
    out = run_distributed(_runs, 2, args=(straggler, hang, str(tmp / "ckpt" / "hang_stacks")), timeout=240)
    return tmp, out


def test_a_rank_slowed_by_a_sleep_is_named_slowest_by_compute_time(runs):
    tmp, _ = runs
    rows = records(str(tmp), "s")
    assert [r["iteration"] for r in rows] == [3, 6]
    host = socket.gethostname()
    for r in rows:
        slowest, fastest = r["straggler_compute_slowest"], r["straggler_compute_fastest"]
        assert [t["rank"] for t in slowest] == [1, 0] and [t["rank"] for t in fastest] == [0, 1], r
        assert {t["host"] for t in slowest} == {host} and [t["node"] for t in slowest] == [1, 0]  # 1 rank per node
        # 4 samples of micro batch 4 per rank and iteration: one forward step, one sleep, per iteration.
        assert slowest[0]["ms"] - fastest[0]["ms"] >= SLEEP * 1000 * 0.9, r
        step = r["straggler_step_slowest"]
        assert sorted(t["rank"] for t in step) == [0, 1] and step[0]["ms"] >= SLEEP * 1000, r  # both wait for it
        assert step[0]["ms"] >= slowest[0]["ms"] * 0.9


def test_a_collective_timeout_names_the_group_and_the_rank_that_did_not_arrive(runs):
    _, ((code0, _, _), (code1, _, named)) = runs
    # Rank 0 waits for its gradient bucket's all-reduce (the group is found on the bucket: with 2
    # ranks the data-parallel group is the world); rank 1 sleeps 10 s in its forward step.
    head = "error: collective timed out after 6 s (--distributed-timeout-minutes 0.1) in the world group (also the "
    assert code0.startswith(head + "data-parallel, "), code0
    site = r"group\), ranks \[0, 1\] \(from megalm/distributed/param_and_grad_buffer\.py:\d+ in finish_grad_sync\); "
    assert re.search(site, code0), code0
    assert "; rank(s) [1] did not reach a collective of this group within 1.5 s after that; gloo: [" in code0
    assert code0.endswith("Timed out waiting 6000ms for recv operation to complete"), code0
    # The blocked rank, once awake, finds rank 0 gone (or times out itself): its error names the group too.
    assert code1.startswith("error: collective ") and "data-parallel" in code1 and "ranks [0, 1]" in code1, code1
    timed_out, lost_peer = named
    assert timed_out == (
        "collective timed out after 90 s (--distributed-timeout-minutes 1.5) in the data-parallel group (also the "
        "data+context-parallel, pipeline-parallel group), ranks [1]; gloo: [gloo/transport/tcp/unbound_buffer.cc:78] "
        "Timed out waiting 90000ms for recv"
    )
    assert lost_peer.startswith(
        "collective lost a peer in the data-parallel group (also the data+context-parallel, pipeline-parallel "
        "group), ranks [1], exchanging with rank 1; gloo: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    ), lost_peer


def _dump_of(text, where):
    dumps = text.split("hang watchdog: ")[1:]
    found = [d for d in dumps if f"last progress: {where}" in d]
    assert found, text[-3000:]
    return found[0]


def test_the_hang_watchdog_dumps_every_ranks_stack_before_the_timeout(runs):
    _, ((_, stacks0, _), (_, stacks1, _)) = runs
    blocked = _dump_of(stacks1, "iteration 4 started")
    assert f"--hang-watchdog-seconds {WATCHDOG_S:g}" in blocked
    assert "in stuck_in_forward_step" in blocked and "in sleeping_forward_step" not in blocked
    waiting = _dump_of(stacks0, "iteration 4 started")
    assert "in finish_grad_sync" in waiting and "stuck_in_forward_step" not in waiting


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

    base = list(MODEL_FLAGS)
    for extra, message in [
        (["--straggler-minmax-count", "0"], "--straggler-minmax-count must be positive, got 0"),
        (["--straggler-ctrlr-port", "70000"], "--straggler-ctrlr-port must be a TCP port (0-65535), got 70000"),
        (
            ["--hang-watchdog-seconds", "60", "--distributed-timeout-minutes", "1"],
            "--hang-watchdog-seconds 60 must be below --distributed-timeout-minutes 1 (60 s)",
        ),
        (["--hang-watchdog-seconds", "-1"], "--hang-watchdog-seconds must be >= 0 (0: off), got -1"),
    ]:
        try:
            validate_config(config_from_args(build_parser().parse_args(base + ["--log-straggler"] + extra)))
        except ConfigError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{extra} accepted")


def test_errors_that_are_not_a_collectives_pass_unchanged():
    from megalm.distributed.collective_errors import CollectiveFailure, describe_failure, named_collective_failures

    def data_loader_wait(group=None):  # a timeout with no process group anywhere in its frames
        raise RuntimeError("DataLoader worker (pid 123) timed out after 5 seconds")

    for error, kind in [(RuntimeError("shape mismatch"), None), (ValueError("Timed out waiting 5ms"), None)]:
        assert describe_failure(error, None, 60.0) is kind
    with pytest.raises(RuntimeError, match="DataLoader worker") as caught:
        with named_collective_failures(lambda: None, 60.0):
            data_loader_wait()
    assert not isinstance(caught.value, CollectiveFailure)

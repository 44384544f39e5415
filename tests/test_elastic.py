"""Elastic resizing under ``torchrun --nnodes MIN:MAX --max-restarts K`` (issue #32, item 2).

Two torchrun agents on loopback ("nodes" A and B, one rank each, c10d rendezvous on A) train with
the distributed optimizer, --save-interval 3, --load = --save.  Node B dies in iteration 5 (its
worker SIGKILLs its agent, then itself): A's worker loses its peer, A's agent restarts it alone
(world 1), which loads iteration 3 saved at DP 2, reshards it to DP 1 and keeps the global batch
(2 micro-batches per step instead of 1) and finishes.

Then the job scales back up, live: once A logged iteration 5 alone, a new node C starts its agent.
A's worker holds its iteration 6 until its agent, seeing a node waiting, SIGTERMs it; with
``--exit-signal-handler`` it finishes that step, saves iteration 6 and exits, and the next round runs
A and C (world 2) from that checkpoint to the end, with no step lost or redone.

Checked: the world-1 iterations' losses and gradient norms are bit for bit those of a one-rank run
from the same checkpoint (``--ckpt-step 3``), the world-2 iterations after the scale-up those of the
same run up to the order of the data-parallel mean (1e-5 and 1e-4 relative); the worlds go 2 -> 1 ->
2, every iteration is logged once but the one in flight at the loss, and every iteration's
consumed-sample count is ``iteration x global batch`` (no sample skipped or repeated across either
resize).  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the shared store, torch's agent caches the
rank-0 address of the first round and a node joining a later round waits for it forever.

Run as a script (``torchrun tests/test_elastic.py ARGS``) this file is the training entry point:
``pretrain_gpt.main`` with ``MEGALM_TEST_KILL_NODE=CALL``, which SIGKILLs this worker's torchrun
agent and then the worker at its CALL-th forward step of the first attempt, and
``MEGALM_TEST_HOLD_ALONE=CALL``, which holds a worker of a one-rank world at its CALL-th forward step
until it receives SIGTERM.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megalm.device import free_port
from tests.training_runs import tiny_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(
    os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
)
GBS, ITERS = 4, 14
FLAGS = tiny_flags(
    hidden_size="32",
    seq_length="16",
    vocab_size="128",
    micro_batch_size="2",
    global_batch_size=str(GBS),
    use_distributed_optimizer=True,
    lr="1e-3",
    seed="11",
    log_world_size_to_tensorboard=True,
)


def _agent(port, *args, host=False, max_restarts=3, nnodes="1:2"):
    """torchrun of one "node" (one rank) joining the c10d rendezvous at 127.0.0.1:``port``
    (``host``: it serves the rendezvous store; on loopback every agent would take itself for the host)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "elastic-test",
        "--rdzv-conf",
        f"is_host={int(host)},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        os.path.abspath(__file__),
        *args,
    ]


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and line.strip().endswith("}")]


def _wait_for(predicate, timeout, what, procs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                pytest.fail(f"{what}: an agent exited with {p.returncode}: {p.communicate()[0][-3000:]}")
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}")


def _spawn(cmd, **env):
    return subprocess.Popen(
        cmd,
        env=dict(ENV, **env),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killed as a whole at the end
    )


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_a_lost_node_resizes_the_job_and_a_new_one_scales_it_back_up(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    args = [*FLAGS, "--train-iters", str(ITERS), "--save", ckpt, "--load", ckpt, "--save-interval", "3"]
    args += ["--metrics-file", metrics, "--exit-signal-handler"]
    port = free_port()
    # A's worker alone: 2 micro-batches a step from iteration 4, so its 5th call is iteration 6's first.
    a = _spawn(_agent(port, *args, host=True), MEGALM_TEST_HOLD_ALONE="5")
    b = _spawn(_agent(port, *args), MEGALM_TEST_KILL_NODE="5")
    procs = [a, b]
    try:
        b.wait(timeout=240)  # killed in iteration 5
        alone = lambda: any(r.get("world-size") == 1 and r["iteration"] >= 5 for r in _records(metrics))  # noqa: E731
        _wait_for(alone, 240, "iteration 5 alone", [a])
        c = _spawn(_agent(port, *args))  # a new node joins the running job
        procs.append(c)
        out_a, _ = a.communicate(timeout=300)
        out_c, _ = c.communicate(timeout=60)
    finally:
        _stop(procs)
    assert b.returncode == -signal.SIGKILL
    assert a.returncode == 0, out_a[-4000:]
    assert c.returncode == 0, out_c[-4000:]
    rows = [r for r in _records(metrics) if "lm_loss" in r]
    # 2 ranks for iterations 1..4, 1 rank from the iteration-3 checkpoint to 6 (saved on SIGTERM), 2 ranks from it.
    assert [(r["iteration"], r["world-size"]) for r in rows] == [(i, 2) for i in range(1, 5)] + [
        (i, 1) for i in range(4, 7)
    ] + [(i, 2) for i in range(7, ITERS + 1)]
    assert "loaded checkpoint from" in out_a and "at iteration 3" in out_a, out_a[-4000:]
    assert "at iteration 6" in out_a.split("at iteration 3", 1)[1], out_a[-4000:]  # the scale-up's load
    for r in rows:
        assert r["consumed_samples"] == r["iteration"] * GBS and r["global_batch_size"] == GBS, r
    # The world-1 attempt equals a one-rank run from the same checkpoint, bit for bit.
    reference = str(tmp_path / "ref.jsonl")
    ref = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *FLAGS, "--train-iters", str(ITERS), "--load", ckpt]
        + ["--ckpt-step", "3", "--metrics-file", reference],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in _records(reference) if "lm_loss" in r}
    shrunk = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in rows if r["world-size"] == 1}
    assert sorted(expected) == list(range(4, ITERS + 1)) and sorted(shrunk) == [4, 5, 6]
    for it in sorted(shrunk):
        assert shrunk[it] == expected[it], (it, shrunk[it], expected[it])
    for r in rows[7:]:  # scaled back up: the same samples, averaged over 2 ranks
        loss, norm = expected[r["iteration"]]
        assert abs(r["lm_loss"] - loss) <= 1e-5 * abs(loss) and abs(r["grad_norm"] - norm) <= 1e-4 * norm, (r, loss)
    # The DP-2 iteration 4 before the loss and its DP-1 redo consumed the same samples: same loss up to
    # the order of the data-parallel mean.
    assert abs(rows[3]["lm_loss"] - rows[4]["lm_loss"]) < 1e-5, (rows[3], rows[4])


def _kill_node_hook(forward_step):
    """``MEGALM_TEST_KILL_NODE=CALL``: SIGKILL this worker's agent (its parent) and then itself at
    the CALL-th forward step of the first attempt: the node is gone."""
    call = int(os.environ.get("MEGALM_TEST_KILL_NODE", "0"))
    if not call or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return forward_step
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(data_iterator, model)

    return step


def _hold_alone_hook(forward_step):
    """``MEGALM_TEST_HOLD_ALONE=CALL``: in a one-rank world, wait at the CALL-th forward step until this
    worker received SIGTERM (its agent restarts it for a node that joins; ``--exit-signal-handler``'s
    handler records the signal, and the step then finishes, saves and exits); at most 200 s."""
    call = int(os.environ.get("MEGALM_TEST_HOLD_ALONE", "0"))
    if not call or os.environ.get("WORLD_SIZE") != "1":
        return forward_step
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == call:
            handler = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
            deadline = time.monotonic() + 200
            while not handler.received() and time.monotonic() < deadline:
                time.sleep(0.05)
        return forward_step(data_iterator, model)

    return step


if __name__ == "__main__":
    import pretrain_gpt
    from megalm.device import shutdown_distributed

    pretrain_gpt.main(sys.argv[1:], _hold_alone_hook(_kill_node_hook(pretrain_gpt.forward_step)))
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank

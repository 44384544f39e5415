"""Restarts resume exactly (issue #18, item 3), on real ranks.

(a) ``torchrun --max-restarts 1`` after one worker is SIGKILLed during iteration 9: the new
    attempt initializes (its store keys are prefixed by the restart count), resumes from the
    iteration-5 checkpoint and logs iterations 6..N bit for bit as an uninterrupted run.
(b) SIGTERM to torchrun with DataLoader workers and ``--exit-signal-handler``: the workers
    ignore it, the trainer finishes its step, saves, logs "exiting at iteration N", and the
    tracker names N.
(c) TP2 x DP2, hidden dropout, no sequence parallelism: after 10 iterations every replicated
    parameter is bitwise equal across the TP group.
(d) A rank whose forward step raises, with DataLoader workers (which ignore SIGTERM): the process
    exits non-zero at once instead of hanging at interpreter exit on its workers.

Run as a script (``torchrun tests/test_restarts.py ARGS``) this file is the training entry
point of (a) and (b): ``pretrain_gpt.main`` with a test hook, ``MEGALM_TEST_SIGKILL=RANK:CALL``,
that SIGKILLs global rank RANK at its CALL-th forward step of the first attempt
(``TORCHELASTIC_RESTART_COUNT=0``), and ``MEGALM_TEST_RAISE=CALL``, that raises RuntimeError at
the CALL-th forward step.
"""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from tests.training_runs import tiny_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
# Dropout and DataLoader workers at their defaults: the restarts must be exact with both.
TINY = tiny_flags(
    hidden_size="32",
    seq_length="16",
    vocab_size="128",
    num_workers=None,
    hidden_dropout=None,
    attention_dropout=None,
    lr="1e-3",
    seed="11",
    micro_batch_size="2",
    global_batch_size="4",
    tensor_model_parallel_size="2",
)
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
ITERS = 30


# --- the torchrun entry point (script mode) ----------------------------------------------


def _sigkill_hook(forward_step):
    """``MEGALM_TEST_SIGKILL=RANK:CALL`` (test hook): SIGKILL this process at its CALL-th forward
    step if it is global rank RANK in the first torchrun attempt; otherwise ``forward_step``."""
    spec = os.environ.get("MEGALM_TEST_SIGKILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return forward_step
    rank, call = (int(x) for x in spec.split(":"))
    if int(os.environ["RANK"]) != rank:
        return forward_step
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGKILL)
        return forward_step(data_iterator, model)

    return step


def _raise_hook(forward_step):
    """``MEGALM_TEST_RAISE=CALL`` (test hook): raise RuntimeError at the CALL-th forward step."""
    call = int(os.environ.get("MEGALM_TEST_RAISE", "0"))
    calls = {"n": 0}

    def step(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError(f"injected failure at forward step {call}")
        return forward_step(data_iterator, model)

    return step if call else forward_step


def _main(argv):
    import pretrain_gpt
    from megalm.device import shutdown_distributed

    pretrain_gpt.main(argv, _raise_hook(_sigkill_hook(pretrain_gpt.forward_step)))
    shutdown_distributed()  # as pretrain_gpt's own entry: gloo's teardown at exit may abort a finished rank


# --- helpers -----------------------------------------------------------------------------


def _torchrun(*args, max_restarts=0):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        os.path.abspath(__file__),
        *args,
    ]


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _numbers(path):
    """``{iteration: (lm_loss, grad_norm)}``; the last record wins (a restart re-logs iterations)."""
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in _rows(path) if "lm_loss" in r}


def _tracker(ckpt):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return f.read().strip()


# --- (a) SIGKILL under torchrun --max-restarts 1 -----------------------------------------


@pytest.fixture(scope="module")
def killed_and_straight(tmp_path_factory):
    """The same training twice, side by side: straight, and with rank 3 SIGKILLed during
    iteration 9 under ``--max-restarts 1`` (--load = --save, --save-interval 5)."""
    tmp = tmp_path_factory.mktemp("restart")
    ckpt = str(tmp / "ckpt")
    common = [*TINY, *DROPOUT, "--num-workers", "0", "--train-iters", str(ITERS)]
    straight = subprocess.Popen(
        _torchrun(*common, "--metrics-file", str(tmp / "straight.jsonl")),
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed = subprocess.Popen(
        _torchrun(
            *common,
            "--metrics-file",
            str(tmp / "killed.jsonl"),
            "--save",
            ckpt,
            "--load",
            ckpt,
            "--save-interval",
            "5",
            max_restarts=1,
        ),
        env=dict(ENV, MEGALM_TEST_SIGKILL="3:9"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out_straight, _ = straight.communicate(timeout=240)
        out_killed, _ = killed.communicate(timeout=240)
    finally:
        straight.kill()
        killed.kill()
    return {
        "tmp": tmp,
        "ckpt": ckpt,
        "straight": (straight.returncode, out_straight),
        "killed": (killed.returncode, out_killed),
    }


def test_sigkilled_worker_restarts_and_resumes_bit_for_bit(killed_and_straight):
    runs = killed_and_straight
    code, out = runs["killed"]
    assert runs["straight"][0] == 0, runs["straight"][1][-3000:]
    assert code == 0, out[-4000:]
    assert "connectFullMesh" not in out, out[-4000:]  # the second attempt met no stale store keys
    assert f"loaded checkpoint from {runs['ckpt']} at iteration 5" in out, out[-4000:]
    straight, killed = _numbers(runs["tmp"] / "straight.jsonl"), _numbers(runs["tmp"] / "killed.jsonl")
    assert sorted(straight) == list(range(1, ITERS + 1))
    assert sorted(killed) == list(range(1, ITERS + 1))
    # The first attempt logged 1..8 (killed in 9); the second re-logged 6.. from the checkpoint.
    iterations = [r["iteration"] for r in _rows(runs["tmp"] / "killed.jsonl") if "lm_loss" in r]
    assert iterations == list(range(1, 9)) + list(range(6, ITERS + 1)), iterations
    for it in range(6, ITERS + 1):
        assert killed[it] == straight[it], (it, killed[it], straight[it])  # bit for bit
    assert _tracker(runs["ckpt"]) == str(ITERS)


def test_restart_store_is_prefixed_by_the_attempt(monkeypatch):
    """Two attempts on one store see disjoint keys; the prefix names the restart count."""
    import torch.distributed as dist

    from megalm.device import restart_store
    from tests.distributed_harness import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # connect as a client, as torchrun's workers
    stores = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        store, rank, world = restart_store(timedelta(seconds=10))
        assert (rank, world) == (0, 1)
        store.set("addr", f"attempt{attempt}")
        stores.append(store)
    assert stores[0].get("addr") == b"attempt0" and stores[1].get("addr") == b"attempt1"
    assert server.check(["megalm/restart0/addr", "megalm/restart1/addr"]) and not server.check(["addr"])
    assert server.get("megalm/restart1/addr") == b"attempt1"
    # A store of this round only (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 serves it): no prefix, which
    # would differ between the agents of one round when a node joins after a restart (its count is 0).
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    store, _, _ = restart_store(timedelta(seconds=10))
    assert not isinstance(store, dist.PrefixStore)


# --- (b) SIGTERM to torchrun with DataLoader workers -------------------------------------


def test_sigterm_to_torchrun_saves_with_dataloader_workers(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        _torchrun(
            *TINY,
            "--num-workers",
            "2",
            "--train-iters",
            "10000",
            "--exit-signal-handler",
            "--save",
            ckpt,
            "--save-interval",
            "100000",
            "--metrics-file",
            str(metrics),
        ),
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not (metrics.exists() and len(_numbers(metrics)) >= 3):
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)  # to torchrun alone: it signals each worker's process group
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert "killed by signal" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "exiting at iteration" in line]
    assert lines and "received SIGTERM (--exit-signal-handler)" in lines[0], out[-3000:]
    n = int(lines[0].split("exiting at iteration ")[1].split(":")[0])
    assert n >= 3
    assert _tracker(ckpt) == str(n)
    assert max(_numbers(metrics)) == n
    assert os.path.isdir(os.path.join(ckpt, f"iter_{n:07d}"))


# --- (d) an exception with DataLoader workers ---------------------------------------------


def test_a_failing_rank_with_dataloader_workers_exits_instead_of_hanging():
    """Before the trainer stopped its loaders' workers in a ``finally``, this process printed the
    traceback and then hung (multiprocessing's exit handler SIGTERMs the workers, which ignore it,
    and joins them; the traceback keeps the DataLoader iterator alive)."""
    argv = tiny_flags(num_workers="2", train_iters="20", micro_batch_size="2", hidden_size="32", seq_length="16")
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv],
            env=dict(ENV, MEGALM_TEST_RAISE="3"),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,  # ~10 s on a quiet machine; hung for good before the fix
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the failing run hung at exit: {(e.stderr or b'')[-2000:]!r}")
    assert proc.returncode != 0
    assert "RuntimeError: injected failure at forward step 3" in proc.stderr, proc.stderr[-3000:]


def test_dataloader_workers_ignore_sigterm_and_leave_the_default_rng_alone():
    """Unit: the worker init ignores SIGTERM; iterating a loader draws nothing from torch's default RNG."""
    from megalm.data.loaders import build_pretraining_data_loader, ignore_sigterm_in_worker

    previous = signal.getsignal(signal.SIGTERM)
    try:
        ignore_sigterm_in_worker(0)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
    loader = build_pretraining_data_loader(list(range(16)), 0, 2, 0, 1, num_workers=0, seed=3)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert [b.tolist() for b in loader][:2] == [[0, 1], [2, 3]]
    assert torch.equal(torch.get_rng_state(), before)


# --- (c) replicated parameters stay equal across TP ranks --------------------------------


def _train_and_compare_replicated(argv):
    """Train on this rank; return ``{name: max |p - p on TP rank 0|}`` of the replicated
    parameters (a broadcast over the TP group per parameter)."""
    import torch.distributed as dist

    import pretrain_gpt
    from megalm import parallel_state as ps
    from megalm.config import parse_config
    from megalm.tensor_parallel.param_info import param_info
    from megalm.training.training import Trainer

    trainer = Trainer(
        parse_config(argv, world_size=dist.get_world_size()), pretrain_gpt.model_provider, pretrain_gpt.forward_step
    )
    trainer.run()
    groups = ps.get_process_groups()
    diffs = {}
    for name, p in trainer.model[0].named_parameters():
        if param_info(p).replicated:
            reference = p.detach().clone()
            dist.broadcast(reference, src=groups.ranks["tp"][0], group=groups.tp)
            diffs[name] = (p.detach() - reference).abs().max().item()
    ps.destroy_model_parallel()
    return diffs


def test_replicated_parameters_equal_across_tp_with_hidden_dropout():
    from tests.distributed_harness import run_distributed

    # Evaluation too: the validation loader starts (draws its workers' seed) on TP rank 0 only.
    argv = [*TINY, *DROPOUT, "--num-workers", "0", "--train-iters", "10", "--eval-interval", "5", "--eval-iters", "1"]
    results = run_distributed(_train_and_compare_replicated, 4, args=(argv,), timeout=200)
    names = set(results[0])
    assert {
        "module.embedding.position_embeddings.weight",
        "module.decoder.final_layernorm.weight",
        "module.decoder.layers.0.mlp.linear_fc2.bias",
    } <= names, names
    for rank, diffs in enumerate(results):
        assert diffs.keys() == names
        assert all(d == 0.0 for d in diffs.values()), (rank, diffs)


if __name__ == "__main__":
    _main(sys.argv[1:])

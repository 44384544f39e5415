"""Run a function on N local spawned ranks (gloo on CPU) and collect every rank's result.

Used by ``bench/`` (multi-rank measurements on one machine) and by the test suite's harness
(``tests/distributed_harness.py``, which adds reused ranks on top)::

    results = run_distributed(my_fn, world_size=4, args=(cfg,), timeout=120)

``my_fn`` must be importable at module level (spawned processes import it).  Each rank is a fresh
process that runs with ``torch.distributed`` initialized (every collective gets a timeout) and one
CPU thread unless ``threads`` says otherwise.  If any rank raises, :class:`DistributedRunError`
carries the traceback of every failing rank; if the ranks do not finish in ``timeout`` seconds they
are killed and the error says which ranks were still running.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalm.device import free_port
from megalm.errors import MegalmError


class DistributedRunError(MegalmError, RuntimeError):
    """A spawned rank raised, died or did not finish in time (the message has every rank's traceback)."""


def run_rank(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: Sequence,
    kwargs: Dict,
    collective_timeout_s: float,
    threads: int,
    env: Dict[str, str],
) -> tuple:
    """Initialize the process group, run ``fn``; ``(rank, "ok", pickled result)`` or
    ``(rank, "error", traceback)``."""
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(threads),
        MEGALM_FORCE_CPU="1",
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        out = fn(*args, **kwargs)
        # Plain pickle (bytes), not torch's fd-sharing reducers: a tensor shared by file descriptor
        # needs this process alive until the parent fetches it, and the teardown below may not allow it.
        return (rank, "ok", pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        return (rank, "error", traceback.format_exc())


def destroy_groups() -> None:
    try:
        from megalm import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: Sequence,
    kwargs: Dict,
    results: "mp.Queue",
    collective_timeout_s: float,
    threads: int,
    env: Dict[str, str],
) -> None:
    """A fresh rank: one call, then exit."""
    message = run_rank(rank, world_size, port, fn, args, kwargs, collective_timeout_s, threads, env)
    try:
        results.put(message)
        # Flushed before the teardown: destroying a group whose collective timed out can abort the process.
        results.close()
        results.join_thread()
    finally:
        destroy_groups()


def run_fresh(fn, world_size, args, kwargs, timeout, threads, env, collective_timeout) -> Dict[int, tuple]:
    """``{rank: (status, payload)}`` of one call on fresh processes (a missing rank did not finish)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, tuple(args), kwargs, results, collective_timeout, threads, dict(env)),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
                outcome[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
            except queue.Empty:
                if any(
                    r not in outcome and not p.is_alive() and p.exitcode not in (0, None) for r, p in enumerate(procs)
                ):
                    time.sleep(0.5)  # let queued messages arrive
                    while True:
                        try:
                            rank, status, payload = results.get_nowait()
                            outcome[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
                        except queue.Empty:
                            break
                    for r, p in enumerate(procs):
                        if r not in outcome and not p.is_alive():
                            outcome[r] = ("error", f"rank {r} died with exit code {p.exitcode}")
                    if any(s == "error" for s, _ in outcome.values()):
                        break
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcome) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return outcome


def check_outcome(outcome: Dict[int, tuple], world_size: int, timeout: float) -> list:
    """The results by rank, or :class:`DistributedRunError` naming every failed or missing rank."""
    errors = {r: payload for r, (status, payload) in sorted(outcome.items()) if status == "error"}
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        lines = [f"--- rank {r} ---\n{tb}" for r, tb in errors.items()]
        if missing:
            lines.append(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        raise DistributedRunError("distributed run failed:\n" + "\n".join(lines))
    return [outcome[r][1] for r in range(world_size)]


def collective_timeout_s(timeout: float) -> float:
    """Collectives time out a little before the whole call does (at least 30 s)."""
    return max(30.0, timeout - 10)


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: Optional[Dict] = None,
    timeout: float = 180.0,
    threads: int = 1,
    env: Optional[Dict[str, str]] = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh spawned ranks; return the results by rank."""
    outcome = run_fresh(fn, world_size, args, kwargs or {}, timeout, threads, env or {}, collective_timeout_s(timeout))
    return check_outcome(outcome, world_size, timeout)

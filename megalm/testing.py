"""Run a function on N real spawned ranks (gloo on CPU) and collect every rank's result.

Used by the test suite and benchmarks::

    results = run_distributed(my_fn, world_size=4, args=(cfg,), timeout=120)

``my_fn`` must be importable at module level (spawned processes import it).  Each rank
runs with ``torch.distributed`` initialized (every collective gets a timeout) and one CPU
thread unless ``threads`` says otherwise.  If any rank raises, :class:`DistributedTestError`
carries the traceback of every failing rank; if the ranks do not finish in ``timeout``
seconds they are killed and the error says which ranks were still running.
"""

from __future__ import annotations

import os
import pickle
import queue
import random
import socket
import time
import traceback
from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalm.errors import MegalmError


class DistributedTestError(MegalmError, RuntimeError):
    pass


def free_port() -> int:
    """A port for a test's rendezvous: random in 20000-32767, below Linux's ephemeral range, so that the
    kernel does not hand it to another process's outgoing connection in the moment between this check and
    rank 0 binding it, and two test runs side by side rarely pick the same one."""
    rng = random.Random()  # seeded by the OS: independent of torch/numpy seeds the tests set
    for _ in range(100):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise DistributedTestError("no free port in 20000-32767 for the test rendezvous")


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
        message = (rank, "ok", pickle.dumps(out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        message = (rank, "error", traceback.format_exc())
    try:
        results.put(message)
        # Flushed before the teardown: destroying a group whose collective timed out can abort the process.
        results.close()
        results.join_thread()
    finally:
        try:
            from megalm import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: Optional[Dict] = None,
    timeout: float = 180.0,
    threads: int = 1,
    env: Optional[Dict[str, str]] = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return the results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    collective_timeout = max(30.0, timeout - 10)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                port,
                fn,
                tuple(args),
                kwargs or {},
                results,
                collective_timeout,
                threads,
                dict(env or {}),
            ),
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
    errors = {r: payload for r, (status, payload) in sorted(outcome.items()) if status == "error"}
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        lines = [f"--- rank {r} ---\n{tb}" for r, tb in errors.items()]
        if missing:
            lines.append(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        raise DistributedTestError("distributed run failed:\n" + "\n".join(lines))
    return [outcome[r][1] for r in range(world_size)]

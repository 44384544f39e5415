"""The test suite's :func:`run_distributed`: :func:`megalm.launch.spawn.run_distributed` with reused ranks.

    results = run_distributed(my_fn, world_size=4, args=(cfg,), timeout=120)

Reused ranks (``MEGALM_TEST_RANK_POOL=1``; see ``tests/conftest.py``). A spawned rank spends ~4 s of CPU importing
torch and megalm (four ranks on two cores: ~8 s a call), so with the variable set the ranks are forked from a fork
server that imported them once (:data:`PRELOAD`; multiprocessing's ``forkserver``), and the ranks of a call stay
alive for the next call of the same world size (:class:`RankPool`; world sizes up to :data:`MAX_POOLED_WORLD`, at
most :data:`MAX_POOLED_RANKS` processes kept, the least recently used pool stopped first; a larger call gets forked
ranks that leave after it). Each call gets a fresh process group on a new port; afterwards the ranks meet at a
barrier, destroy it, and restore what a call may change and a fresh process would not have: ``os.environ``, the
working directory, signal handlers, ``sys.stdout/stderr``, warning filters (and their once-only registries), the
root and ``megalm`` loggers, torch's default dtype, grad mode, anomaly mode and deterministic mode, and it reseeds
torch's default generator from the OS, as a fresh process starts. It retires (the next call starts fresh processes)
when the call left something it cannot restore: a thread or child process still running, a process group still
alive (its gloo threads, counted by name in ``/proc/self/task``, still running after a garbage collection:
something kept a reference to it), a changed ``sys.path``, a rebound function or class attribute of ``megalm``,
``pretrain_gpt``, ``torch.distributed`` or a ``tests`` module, or a megalm attribute bound to a function defined in
``tests`` (a monkeypatch not undone). A rank that raises leaves after reporting (as a fresh one does); any failure
or timeout kills the pool's processes. ``MEGALM_TEST_RANK_POOL_LOG=<file>`` appends to the file each pool's start,
each call, each retirement's reason and, when a pool closes, its ranks' thread counts. Calls with ``env`` always
get fresh processes (some variables are read at import), and so does everything when the variable is unset
(benchmarks: their memory numbers are per fresh process).

Why a destroyed group can keep threads: ``dist.destroy_process_group()`` only forgets the groups; a gloo
group's threads (two ``pt_gloo_runloop`` workers and a ``gloo_tcp_loop`` per group, the ``pt_tcpstore_uv``
server on rank 0) stop when its last reference goes.  Two references outlived every call: a
``DistributedDataParallel``'s gradient hooks (a cycle through the parameters' C++ hook lists that the
garbage collector cannot see; the hooks now hold the wrapper weakly), and the default argument
``group=WORLD`` of ``torch.distributed.nn.functional``, evaluated when that module is first imported
(by ``torch.distributed.checkpoint``) while a call's group exists: a reused rank imports it at start-up.
"""

from __future__ import annotations

import atexit
import collections
import gc
import logging
import multiprocessing.util  # noqa: F401 - its atexit handler must be registered before ours (see _pool)
import os
import pickle
import signal
import sys
import threading
import time
import types
import warnings
from multiprocessing.connection import wait
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalm.device import free_port  # noqa: F401 - the one port picker (tests import it from here too)
from megalm.launch.spawn import (
    DistributedRunError,
    check_outcome,
    collective_timeout_s,
    destroy_groups,
    run_fresh,
    run_rank,
)

DistributedTestError = DistributedRunError  # the name the tests use

POOL_ENV = "MEGALM_TEST_RANK_POOL"
MAX_POOLED_WORLD = 4  # larger calls are rare in the suite: fresh processes
# What a reused rank's fork server imports once (a rank forked from it starts with them: ~4 s of CPU each
# otherwise, most of it torch._dynamo, which torch.optim imports, and torch.distributed.checkpoint).  The server
# runs no torch operation, so it starts no thread a fork could lose; ``torch.distributed.nn.functional`` is
# imported while no process group exists (module docstring).
PRELOAD = [
    "torch",
    "torch.distributed.nn.functional",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "pretrain_gpt",
    "megalm.training.training",
    "tests.distributed_harness",
    "tests.training_runs",
]
MAX_POOLED_RANKS = 7  # processes kept alive over all world sizes (1 + 2 + 4; each holds torch + megalm)
_READY_TIMEOUT_S = 30.0
# Thread names of a live process group's gloo context and of a TCPStore server (torch 2.x on Linux).
_GROUP_THREAD_PREFIXES = ("pt_gloo", "gloo", "pt_tcpstore")


def group_thread_count(pid: Optional[int] = None) -> int:
    """Threads of process ``pid`` (default this one) that belong to live process groups and stores
    (names in :data:`_GROUP_THREAD_PREFIXES`; ``threading`` does not see these C++ threads); 0 without ``/proc``."""
    return sum(name.startswith(_GROUP_THREAD_PREFIXES) for name in _thread_names(pid))


def _thread_names(pid: Optional[int] = None) -> list:
    tasks = f"/proc/{pid or 'self'}/task"
    names = []
    try:
        for tid in os.listdir(tasks):
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
    except OSError:  # no /proc, or a thread (process) ended while being read
        pass
    return names


_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM") if hasattr(signal, n)
)
_LOGGERS = ("", "megalm")


def _watched_modules() -> Dict[str, types.ModuleType]:
    return {
        name: m
        for name, m in list(sys.modules.items())
        if m is not None
        and (name in ("pretrain_gpt", "torch.distributed") or name.split(".")[0] in ("megalm", "tests"))
    }


def _code_attrs(module: types.ModuleType) -> Dict[str, object]:
    """The functions and classes a module's namespace binds (what a monkeypatch rebinds)."""
    with warnings.catch_warnings():  # deprecated objects (torch.distributed.reduce_op) warn on isinstance
        warnings.simplefilter("ignore")
        return {
            k: v
            for k, v in list(vars(module).items())
            if isinstance(v, (types.FunctionType, type)) and not k.startswith("__")
        }


class _ProcessState:
    """What a reused rank looks like between calls: captured once after start-up, restored after
    every call; :meth:`restore` returns why the rank must retire instead (None: reusable)."""

    def __init__(self):
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.signals = {s: signal.getsignal(s) for s in _SIGNALS}
        self.streams = (sys.stdout, sys.stderr)
        self.sys_path = list(sys.path)
        self.warning_filters = list(warnings.filters)
        self.loggers = {}
        for name in _LOGGERS:
            lg = logging.getLogger(name)
            self.loggers[name] = (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.threads = set(threading.enumerate())
        self.group_threads = group_thread_count()
        self.attrs = {}
        self.snapshot_modules()

    def snapshot_modules(self) -> None:
        for name, m in _watched_modules().items():
            if name not in self.attrs:
                self.attrs[name] = _code_attrs(m)

    def leftovers(self) -> Optional[str]:
        """Why this process is not as a fresh one would be, in ways that cannot be undone here."""
        gc.collect()  # objects of the call in reference cycles (DataLoader iterators and their workers)
        deadline = time.monotonic() + 2.0  # let finishing background threads (checkpoint writers) end
        while True:
            threads = [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]
            group_threads = group_thread_count() - self.group_threads
            if (not threads and group_threads <= 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if threads:
            return f"threads still running: {[t.name for t in threads]}"
        if group_threads > 0:
            return f"{group_threads} threads of destroyed process groups still running (a group is still referenced)"
        children = multiprocessing.active_children()
        if children:
            for p in children:
                p.kill()
            return f"child processes still running: {[p.name for p in children]}"
        if sys.path != self.sys_path:
            return "sys.path changed"
        for name, attrs in self.attrs.items():
            module = sys.modules.get(name)
            if module is None:
                return f"module {name} removed"
            for k, v in attrs.items():
                if vars(module).get(k) is not v:
                    return f"{name}.{k} rebound"
        for name, module in _watched_modules().items():
            if name.split(".")[0] != "megalm":
                continue
            for k, v in _code_attrs(module).items():
                if isinstance(v, types.FunctionType) and (v.__module__ or "").split(".")[0] == "tests":
                    return f"{name}.{k} bound to {v.__module__}.{v.__qualname__}"
        return None

    def restore(self) -> Optional[str]:
        reason = self.leftovers()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        for s, handler in self.signals.items():
            if handler is not None and signal.getsignal(s) is not handler:
                signal.signal(s, handler)
        sys.stdout, sys.stderr = self.streams
        warnings.filters[:] = self.warning_filters
        mutated = getattr(warnings, "_filters_mutated", None)  # empties every module's once-only registry
        if mutated is not None:
            mutated()
        for name, (handlers, level, propagate, disabled) in self.loggers.items():
            lg = logging.getLogger(name)
            for h in list(lg.handlers):
                if h not in handlers:
                    lg.removeHandler(h)
                    h.close()
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.seed()  # a fresh process's default generator starts from a random seed too
        self.snapshot_modules()  # modules this call imported: watched from now on
        return reason


def _pool_worker(rank: int, conn, environ: Dict[str, str]) -> None:
    """A reused rank: runs calls received on ``conn`` until told to stop, the parent is gone, a
    call fails, or a call left the process in a state it cannot restore.  ``environ``: the test process's
    environment (a forked rank starts with the fork server's)."""
    os.environ.clear()
    os.environ.update(environ)
    import numpy

    numpy.random.seed()  # from the OS, as a fresh process (Python's random is reseeded at fork; torch starts as one)
    parent = os.getppid()

    def leave_with_the_parent():  # a killed parent (pytest stopped mid-call) takes its ranks with it
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=leave_with_the_parent, name="rank-pool-parent-watch", daemon=True).start()
    import torch.distributed.nn.functional  # noqa: F401 - before any group: its defaults bind group.WORLD (docstring)

    state = _ProcessState()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        world_size, port, fn, args, kwargs, collective_timeout_s, threads = task
        message = run_rank(rank, world_size, port, fn, args, kwargs, collective_timeout_s, threads, {})
        conn.send(message)  # synchronous: written before the teardown, which can abort after a timed-out collective
        if message[1] == "error":
            destroy_groups()
            return  # as a fresh rank: the peers see it leave
        try:  # every rank done with the group (a peer may still be connecting) before it goes
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer failed: the parent sees its error
            pass
        destroy_groups()
        reason = state.restore()
        conn.send((rank, "ready", reason))
        if reason is not None:
            return


class RankPool:
    """``world_size`` spawned ranks reused by :func:`run_distributed` (see the module docstring)."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first pool of the session)
        self.world_size = world_size
        pipes = [ctx.Pipe() for _ in range(world_size)]
        self.conns = [parent for parent, _ in pipes]
        environ = dict(os.environ)
        self.procs = [
            ctx.Process(target=_pool_worker, args=(r, child, environ), daemon=False)
            for r, (_, child) in enumerate(pipes)
        ]
        for p in self.procs:
            p.start()
        for _, child in pipes:
            child.close()
        _pool_log(f"world size {world_size}: ranks started, pids {[p.pid for p in self.procs]}")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, task: tuple, timeout: float) -> Dict[int, tuple]:
        """Send ``task`` to every rank and collect ``{rank: (status, payload)}`` within ``timeout``
        (a rank that dies without a message counts as an error); raises :class:`BrokenPipeError`
        if a rank left before the call."""
        for conn in self.conns:
            conn.send(task)
        outcome: Dict[int, tuple] = {}
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._receive(pending, outcome, min(remaining, 1.0)):  # a rank died: as a fresh run, stop
                self._receive(pending, outcome, 0.5)  # after the messages already sent
                break
        return outcome

    def _receive(self, pending: Dict, outcome: Dict, timeout: float) -> bool:
        """Read the results that arrive within ``timeout``; True if a rank died without one."""
        died = False
        for conn in wait(list(pending.values()), timeout=timeout):
            rank = self.conns.index(conn)
            del pending[rank]
            try:
                _, status, payload = conn.recv()
            except (EOFError, OSError):
                self.procs[rank].join(timeout=1.0)
                outcome[rank] = ("error", f"rank {rank} died with exit code {self.procs[rank].exitcode}")
                died = True
                continue
            outcome[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
        return died

    def wait_ready(self) -> bool:
        """After a successful call: every rank restored its state and stays (False: retire the pool)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        pending = dict(enumerate(self.conns))
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=1.0):
                rank = self.conns.index(conn)
                try:
                    _, status, reason = conn.recv()
                except (EOFError, OSError):
                    return False
                del pending[rank]
                if status != "ready" or reason is not None:
                    _pool_log(f"world size {self.world_size}, rank {rank} retires: {reason}")
                    return False
        return not pending

    def close(self) -> None:
        counts = [len(_thread_names(p.pid)) for p in self.procs]
        groups = [group_thread_count(p.pid) for p in self.procs]
        _pool_log(f"world size {self.world_size}: closed; threads per rank {counts}, of process groups {groups}")
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
        for conn in self.conns:
            conn.close()


def _pool_log(line: str) -> None:
    """Append ``line`` to the file named by ``MEGALM_TEST_RANK_POOL_LOG``, if set."""
    log = os.environ.get(POOL_ENV + "_LOG")
    if log:
        with open(log, "a") as f:
            f.write(line + "\n")


# The suite's pools by world size, least recently used first (processes, not library state).
_POOLS: "collections.OrderedDict[int, RankPool]" = collections.OrderedDict()


def close_rank_pools() -> None:
    """Stop every reused rank (registered with ``atexit``; the test suite also calls it at its end)."""
    while _POOLS:
        _, pool = _POOLS.popitem(last=False)
        pool.close()


# Registered after multiprocessing's own exit handler (imported above), so it runs first: that handler
# joins non-daemonic children, and idle reused ranks only leave when told to.
atexit.register(close_rank_pools)


def _pool(world_size: int) -> RankPool:
    pool = _POOLS.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.kill()
        pool = None
    if pool is None:
        while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > MAX_POOLED_RANKS:
            _POOLS.popitem(last=False)[1].close()
        pool = RankPool(world_size)
    _POOLS[world_size] = pool
    return pool


def _run_pooled(fn, world_size, args, kwargs, timeout, threads, collective_timeout) -> Dict[int, tuple]:
    task = (world_size, free_port(), fn, tuple(args), kwargs, collective_timeout, threads)
    pool = _pool(world_size)
    kept = False
    try:
        try:
            outcome = pool.run(task, timeout)
        except (BrokenPipeError, ConnectionResetError):  # a rank left since the last call: start afresh
            _POOLS.pop(world_size, None)
            pool.kill()
            pool = _pool(world_size)
            outcome = pool.run(task, timeout)
        ok = len(outcome) == world_size and all(s == "ok" for s, _ in outcome.values())
        kept = ok and pool.wait_ready()
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
        _pool_log(f"world size {world_size}: call {name} ok={ok} kept={kept}")
    finally:
        if not kept:
            _POOLS.pop(world_size, None)
            pool.kill()
    return outcome


def run_distributed(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    kwargs: Optional[Dict] = None,
    timeout: float = 180.0,
    threads: int = 1,
    env: Optional[Dict[str, str]] = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks (reused ones with ``MEGALM_TEST_RANK_POOL=1``);
    return the results by rank."""
    collective_timeout = collective_timeout_s(timeout)
    if env or os.environ.get(POOL_ENV, "0") != "1":
        outcome = run_fresh(fn, world_size, args, kwargs or {}, timeout, threads, env or {}, collective_timeout)
    elif world_size > MAX_POOLED_WORLD:  # forked from the fork server (its imports done), not kept
        task = (world_size, free_port(), fn, tuple(args), kwargs or {}, collective_timeout, threads)
        pool = RankPool(world_size)
        try:
            outcome = pool.run(task, timeout)
            ok = len(outcome) == world_size and all(s == "ok" for s, _ in outcome.values())
            if ok and pool.wait_ready():
                pool.close()
        finally:
            pool.kill()
    else:
        outcome = _run_pooled(fn, world_size, args, kwargs or {}, timeout, threads, collective_timeout)
    return check_outcome(outcome, world_size, timeout)

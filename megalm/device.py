"""The one place that picks the compute device and the communication backend.

CUDA + NCCL when a GPU is visible, CPU + gloo otherwise.  Nothing else in megalm calls
``.cuda()`` or names a backend: ask :func:`get_device` and :func:`get_backend`.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from megalm.errors import MegalmError

DEFAULT_TIMEOUT = timedelta(minutes=10)


def use_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("MEGALM_FORCE_CPU", "0") != "1"


def get_backend() -> str:
    return "nccl" if use_cuda() else "gloo"


def get_device() -> torch.device:
    if use_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def configure_cpu_threads() -> int:
    """On CPU give each local rank ``cores // local ranks`` threads, unless OMP_NUM_THREADS is set."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // max(1, local_world_size()))
    torch.set_num_threads(threads)
    return threads


def initialize_distributed(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialize torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    A single process with no torchrun environment gets a world of one on a local port.  Under
    torchrun the default group's store keys are prefixed by the restart count
    (:func:`restart_store`), so a group restarted by ``--max-restarts`` after a worker died
    does not meet the dead attempt's keys in the rendezvous store.
    """
    if dist.is_initialized():
        return
    if use_cuda():
        torch.cuda.set_device(local_rank())
    else:
        configure_cpu_threads()
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    # On CUDA name this rank's GPU: NCCL then binds its communicators to it instead of guessing
    # from the global rank (which can hang on heterogeneous rank-to-GPU maps).
    device = {"device_id": get_device()} if use_cuda() else {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        store, rank, world = restart_store(timeout)
        dist.init_process_group(
            backend=get_backend(), timeout=timeout, store=store, rank=rank, world_size=world, **device
        )
    else:
        dist.init_process_group(backend=get_backend(), timeout=timeout, **device)


def restart_store(timeout: timedelta = DEFAULT_TIMEOUT) -> tuple:
    """``(store, rank, world_size)`` of torchrun's ``env://`` rendezvous.

    The agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default) outlives a restart:
    its keys are prefixed by ``megalm/restart{TORCHELASTIC_RESTART_COUNT}/``, so each attempt of an
    elastic group (``torchrun --max-restarts N``) sees only its own (without the prefix the new
    attempt reads the dead one's addresses and gloo's ``connectFullMesh`` fails with "Connection
    refused").  With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 serves a new store every round:
    no prefix, and none may be used: when a node joins after a failure its agent's restart count (0)
    is not the others' (1), and prefixed by it, its ranks and theirs would wait for each other's keys
    forever."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store, rank, world
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    return dist.PrefixStore(f"megalm/restart{attempt}", store), rank, world


def fault_tolerant_process_group(timeout: timedelta):
    """torchft's reconfigurable process group for data parallelism across replica groups
    (:mod:`megalm.resilience.torchft_replicas`): NCCL on CUDA, gloo otherwise.  torchft must be
    importable (the caller checks)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if use_cuda() else ProcessGroupGloo(timeout=timeout)


class NoFreePort(MegalmError, OSError):
    """No port in :data:`PORT_RANGE` could be bound for a rendezvous."""


PORT_RANGE = (20000, 32768)  # below Linux's ephemeral range (32768-60999)


def free_port() -> int:
    """A port for a rendezvous on this host (a single-process run's, a test's): random in 20000-32767,
    below Linux's ephemeral range, so that the kernel does not hand it to another process's outgoing
    connection in the moment between this check and rank 0 binding it, and two runs side by side
    rarely pick the same one.  The one port picker of megalm and its tests."""
    rng = random.Random()  # seeded by the OS: independent of torch/numpy seeds the caller set
    for _ in range(100):
        port = rng.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise NoFreePort(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} for the rendezvous (100 tried)")


def shutdown_distributed() -> None:
    """End a script's distributed run cleanly: a barrier (every rank has finished all of its
    communication), then ``destroy_process_group``.  On gloo the process then leaves with
    ``os._exit(0)`` after flushing its output: gloo's C++ teardown at interpreter exit can abort
    ("terminate called without an active exception", exit -6) in one rank of a run whose work
    was all done, which torchrun reports as a failed job.  Call it only after the work succeeded
    and was written (metrics, checkpoints, loggers closed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gloo = dist.get_backend() == "gloo"
    dist.barrier()
    dist.destroy_process_group()
    if gloo:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def synchronize() -> None:
    if use_cuda():
        torch.cuda.synchronize()


def side_stream():
    """A new CUDA stream on the current device (for copies that overlap compute), or None on a
    CPU-only machine, where copies are synchronous (:class:`megalm.host_transfer.HostTransfer`)."""
    return torch.cuda.Stream() if use_cuda() else None

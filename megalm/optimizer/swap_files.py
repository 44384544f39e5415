"""One rank's swap files for the NVMe optimizer offload (:mod:`megalm.optimizer.nvme_offload`): one file
per bucket under ``--offload-path``, read into and written from host staging buffers by one background
thread.

A file is a 4096-byte header (JSON: format, run id, rank, bucket, payload bytes, pid, host, creation time)
followed by the payload at offset 4096.  The files are created (``posix_fallocate``, so their blocks are
reserved before training) and locked (``flock``, exclusive) when the optimizer is built, and removed at
close or exit.  A file that already exists is another run's, live (its lock is held) or crashed: refused,
naming that run, before anything is written.

Reads and writes go through a single worker thread in submission order (FIFO), so a read into a staging
slot submitted after the write out of that slot starts only once the write finished; ``pread``/``pwrite``
release the GIL, so the I/O overlaps the optimizer's CPU work.  ``bytes_read`` / ``bytes_written`` count
the payload bytes of the steps' whole-bucket transfers; ``ranges_read`` / ``ranges_written`` those of
:meth:`SwapFiles.read_range` / :meth:`SwapFiles.write_range` (a checkpoint streaming single tensors to and
from the files).  No communication.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import torch

from megalm.errors import MegalmError

HEADER_BYTES = 4096
FORMAT = "megalm-optimizer-swap-v1"


class SwapError(MegalmError, OSError):
    """A swap directory or file that cannot be used (missing, unwritable, full, another run's, I/O failed)."""


def check_swap_dir(path: str) -> Optional[str]:
    """What is wrong with ``path`` as a swap directory (None when it is an existing, writable directory)."""
    if not os.path.exists(path):
        return f"--offload-path {path} does not exist: create the directory (on local disk) first"
    if not os.path.isdir(path):
        return f"--offload-path {path} is not a directory"
    probe = os.path.join(path, f".megalm-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
        os.remove(probe)
    except OSError as e:
        return f"--offload-path {path} is not writable: {e.strerror or e}"
    return None


def swap_file_name(directory: str, rank: int, bucket: int) -> str:
    return os.path.join(directory, f"megalm-optim-rank{rank:05d}-bucket{bucket:03d}.swap")


def _describe_owner(path: str) -> str:
    """Whose file ``path`` is, from its header (best effort)."""
    try:
        with open(path, "rb") as f:
            head = json.loads(f.read(HEADER_BYTES).rstrip(b"\0 ").decode())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(head.get("created", 0)))
        return f"run {head.get('run')} (pid {head.get('pid')} on {head.get('host')}, created {when} UTC)"
    except (OSError, ValueError, UnicodeDecodeError):
        return "an unknown writer (no megalm swap header)"


class SwapFiles:
    """The payload files of one rank (sizes ``payload_bytes[k]`` for bucket ``k``); see the module docstring."""

    def __init__(self, directory: str, rank: int, payload_bytes: Sequence[int]):
        problem = check_swap_dir(directory)
        if problem:
            raise SwapError(problem)
        self.paths = [swap_file_name(directory, rank, k) for k in range(len(payload_bytes))]
        self.sizes = list(payload_bytes)
        self.bytes_read = self.bytes_written = 0  # whole buckets (the steps)
        self.ranges_read = self.ranges_written = 0  # byte ranges (checkpoints)
        self.fds: List[int] = []
        taken = [p for p in self.paths if os.path.exists(p)]
        if taken:
            raise SwapError(
                f"swap file {taken[0]} already exists: it belongs to {_describe_owner(taken[0])}; another run uses "
                f"--offload-path {directory}, or one that crashed left it: give this run its own directory, or "
                "delete the old run's megalm-optim-*.swap files"
            )
        need = sum(HEADER_BYTES + n for n in self.sizes)
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise SwapError(
                f"--offload-path {directory} has {free / 2**20:.1f} MiB free, this rank's optimizer swap files need "
                f"{need / 2**20:.1f} MiB: free space, lower --optimizer-offload-fraction or use another disk"
            )
        self.run = uuid.uuid4().hex
        header = {"format": FORMAT, "run": self.run, "rank": rank, "pid": os.getpid()}
        header |= {"host": socket.gethostname(), "created": time.time()}
        try:
            for k, (path, size) in enumerate(zip(self.paths, self.sizes)):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                blob = json.dumps(header | {"bucket": k, "payload_bytes": size}).encode()
                os.pwrite(fd, blob.ljust(HEADER_BYTES, b" "), 0)
                if size:
                    os.posix_fallocate(fd, HEADER_BYTES, size)
        except OSError as e:
            self.close()
            if e.errno == 28:  # ENOSPC: another process took the space since the check
                raise SwapError(f"--offload-path {directory}: no space left for {need / 2**20:.1f} MiB") from e
            if isinstance(e, FileExistsError):
                raise SwapError(f"swap file {e.filename} appeared while this run created its own") from e
            raise SwapError(f"cannot create swap files under --offload-path {directory}: {e}") from e
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalm-swap")

    def read(self, bucket: int, dst: torch.Tensor) -> Future:
        """Queue: ``dst`` (a contiguous uint8 host tensor of the bucket's size) <- the bucket's payload."""
        return self.pool.submit(self._io, bucket, dst, False, (), 0, self.sizes[bucket], "bytes_read")

    def write(self, bucket: int, src: torch.Tensor, before: Sequence[Callable[[], None]] = ()) -> Future:
        """Queue: the bucket's payload <- ``src``, after the calls ``before`` (e.g. waits for copies still
        reading ``src``) ran in the worker."""
        return self.pool.submit(self._io, bucket, src, True, tuple(before), 0, self.sizes[bucket], "bytes_written")

    def read_range(self, bucket: int, offset: int, dst: torch.Tensor) -> Future:
        """Queue: ``dst`` (contiguous, host) <- its size in bytes of the bucket's payload from byte ``offset``
        (after every transfer queued before it)."""
        return self.pool.submit(
            self._io, bucket, dst, False, (), offset, dst.numel() * dst.element_size(), "ranges_read"
        )

    def write_range(self, bucket: int, offset: int, src: torch.Tensor) -> Future:
        """Queue: the bucket's payload from byte ``offset`` <- ``src`` (contiguous, host)."""
        return self.pool.submit(
            self._io, bucket, src, True, (), offset, src.numel() * src.element_size(), "ranges_written"
        )

    def _io(self, bucket: int, buf: torch.Tensor, write: bool, before, start: int, size: int, counter: str) -> None:
        for wait in before:
            wait()
        if start < 0 or start + size > self.sizes[bucket]:
            raise SwapError(f"bytes [{start}, {start + size}) lie outside bucket {bucket}'s {self.sizes[bucket]}")
        if size > buf.numel() * buf.element_size() or not buf.is_contiguous():
            raise SwapError(f"a swap transfer of {size} bytes needs a contiguous host buffer of at least that size")
        # A view of the buffer's memory (not .numpy(), which would pin the storage's size: a checkpoint frees
        # the blocks it streamed by emptying their storage).
        view = memoryview((ctypes.c_char * size).from_address(buf.data_ptr())).cast("B") if size else memoryview(b"")
        fd, done = self.fds[bucket], 0
        try:
            while done < size:
                if write:
                    n = os.pwrite(fd, view[done:], HEADER_BYTES + start + done)
                else:
                    n = os.preadv(fd, [view[done:]], HEADER_BYTES + start + done)
                if n <= 0:
                    raise OSError(f"short {'write' if write else 'read'} at byte {done} of {size}")
                done += n
        except OSError as e:
            raise SwapError(f"{'writing' if write else 'reading'} swap file {self.paths[bucket]} failed: {e}") from e
        setattr(self, counter, getattr(self, counter) + size)

    def close(self) -> None:
        """Stop the worker, unlock and remove the files (idempotent)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
            self.pool = None
        for fd, path in zip(self.fds, self.paths):
            try:
                os.close(fd)
                os.remove(path)
            except OSError:
                pass
        self.fds = []

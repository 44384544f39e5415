"""Checkpoint errors: :class:`CheckpointError`, sharing every rank's error (:func:`gather_errors`),
and one-line descriptions of I/O errors.

DCP reports a failed write or read as ``CheckpointException`` (a ``BaseException``) holding each
failed rank's exception and traceback, and ``torch.save``'s zip writer reports a full disk as
``enforce fail at inline_container.cc ... file write failed`` with no errno.
:func:`describe_io_error` turns either into one line: the innermost errors' types and first
lines, prefixed with "No space left on device" when the disk is full (an ``ENOSPC`` in the
chain, or less than 1 MiB left where the checkpoint was being written).
:func:`save_dir_problem` says what is wrong with a ``--save`` path before any work.  Only
:func:`gather_errors` communicates.
"""

from __future__ import annotations

import errno
import os
import pickle
from typing import List, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megalm.errors import MegalmError


class CheckpointError(MegalmError, RuntimeError):
    """A checkpoint cannot be written, found, verified or read; the message names the file or directory."""


def gather_errors(error: Optional[str], group=None) -> List[tuple]:
    """Collective (one ``all_gather_object`` over ``group``, default the world; none when not
    initialized): ``[(rank, error), ...]`` of the ranks that report one."""
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    return [(r, e) for r, e in enumerate(errors) if e]


def describe_io_error(e: BaseException, path: str, writing: bool = True) -> str:
    """One line for an I/O error: the chained errors' types and first lines (innermost first),
    and for a write, "No space left on device" first when the disk is full (torch.save's writer
    reports only "file write failed")."""
    leaves = leaf_errors(e)
    text = "; ".join(dict.fromkeys(f"{type(x).__name__}: {first_line(x)}" for x in leaves))
    full = (
        any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in leaves)
        or "No space left on device" in text
        or (writing and disk_nearly_full(path))
    )
    return f"No space left on device ({text})" if full and writing else text


def leaf_errors(e: BaseException) -> List[BaseException]:
    if isinstance(e, CheckpointException):
        return [x for exc, _ in e.failures.values() for x in leaf_errors(exc)]
    inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)  # `raise ... from None` hides it
    return leaf_errors(inner) + [e] if inner is not None else [e]


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message; for a pickle ``torch.load(weights_only=True)`` refused, the
    line naming what it refused (its first line would advise loading the file with ``weights_only=False``)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if isinstance(e, pickle.UnpicklingError) and lines and lines[0].startswith("Weights only load failed"):
        return "refusing to unpickle: " + (lines[1] if len(lines) > 1 else lines[0])
    return lines[0] if lines else ""


def disk_nearly_full(path: str) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def save_dir_problem(save: str) -> Optional[str]:
    """None if ``save`` is a writable directory, or is missing and its nearest existing parent is a
    writable directory (nothing is created); else what is wrong, to follow ``--save <save>``."""
    existing = save
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing):
        return "is not a directory" if existing == save else f"cannot be created: {existing} is not a directory"
    if existing != save:
        return None if os.access(existing, os.W_OK | os.X_OK) else f"cannot be created: {existing} is not writable"
    probe = os.path.join(save, f".megalm_write_test.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        return f"is not a writable directory: {e.strerror or e}"
    return None

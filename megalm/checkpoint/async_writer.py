"""``--async-save``: checkpoint tensors written by a background thread while training goes on.

:func:`megalm.checkpoint.save.save_checkpoint` with an :class:`AsyncCheckpointWriter` does the
short part at once (wait for the previous save, prepare the directory, copy every tensor it
saves to new CPU memory: the staging that makes the checkpoint the state of *this* iteration
whatever the next optimizer steps change, write the per-rank RNG files) and hands the rest to
the writer's thread: the DCP write over a gloo group of its own (the writer's ``group``, built by
the entry point: :func:`megalm.parallel_state.get_checkpoint_io_group`), then, on rank 0, ``common.json``; each
rank hashes its files into its manifest (:mod:`megalm.checkpoint.manifest`) and one
``all_gather_object`` on that group shares every rank's outcome; then rank 0 writes the
manifest index and the tracker file.  So the tracker is written last, only once every rank's
files and manifest are on disk, and a checkpoint that was still being written when a job died
is never the one resumed from; a write that failed on any rank fails the save on every rank.

At most one save is in flight: the next save, the end of training and an early exit wait for it
(:meth:`AsyncCheckpointWriter.wait`), and a failure in the thread is raised there.  Staging
holds one extra CPU copy of this rank's checkpointed tensors until the write finishes.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from megalm.errors import MegalmError


class AsyncSaveError(MegalmError, RuntimeError):
    """The background write of a checkpoint failed."""


class AsyncCheckpointWriter:
    """Runs one checkpoint write at a time in a background thread; ``group``: the gloo group over every
    rank its writes communicate over (one of their own, so that they never interleave with training's
    collectives; None in a single process)."""

    def __init__(self, group=None):
        self.group = group
        self._thread: Optional[threading.Thread] = None
        self._iteration: Optional[int] = None
        self._error: Optional[BaseException] = None

    @property
    def in_flight(self) -> Optional[int]:
        """The iteration being written, or None."""
        return self._iteration if self._thread is not None else None

    def done(self) -> bool:
        """True when no write is running (a finished one may still need :meth:`wait` for its result)."""
        return self._thread is None or not self._thread.is_alive()

    def submit(self, iteration: int, write: Callable[[], None]) -> None:
        """Start ``write()`` in the background (after the previous write finished)."""
        self.wait()

        def run():
            try:
                write()
            except BaseException as e:  # noqa: BLE001 - re-raised in wait()
                self._error = e

        self._iteration, self._error = iteration, None
        self._thread = threading.Thread(target=run, name=f"megalm-async-save-{iteration}", daemon=False)
        self._thread.start()

    def wait(self) -> Optional[int]:
        """Block until the write in flight finishes; returns its iteration (None when there was
        none).  Raises :class:`AsyncSaveError` if it failed."""
        if self._thread is None:
            return None
        self._thread.join()
        iteration, error = self._iteration, self._error
        self._thread = self._iteration = self._error = None
        if error is not None:
            raise AsyncSaveError(
                f"the background save of iteration {iteration} failed: {type(error).__name__}: {error}"
            ) from error
        return iteration

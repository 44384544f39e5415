"""The hang watchdog (``--hang-watchdog-seconds S``): every rank's Python stacks when training
stops making progress, before the collective timeout ends the job.

A daemon thread per rank watches a timestamp that the training loop moves at the start of each
iteration and after its step, evaluation and checkpoint (:meth:`HangWatchdog.progress`: one
clock read, nothing else on the step).  When it has not moved for ``S`` seconds, the thread
writes, once per stall, a header (rank, seconds, the last progress point) and the stack of every
Python thread of the rank (:func:`faulthandler.dump_traceback`) to stderr and, when a directory
is given (``--hang-watchdog-dir``, default ``<--save>/hang_stacks``), appends them to
``<dir>/rank_<rank>.txt``.  A rank stuck in a computation shows that function on top; a rank
waiting for it shows the collective it waits in.  Progress re-arms it.

Every rank runs its own watchdog and no rank communicates for it, so a rank that waits for a
dead or cut-off peer still dumps.  Off by default (0): a useful ``S`` lies above the longest
iteration (including its evaluation and checkpoint save) and below ``--distributed-timeout-minutes``,
and only the user knows the first (validation refuses ``S`` at or above the timeout).  The
thread needs the GIL: a hang inside C code that holds it (torch and gloo release it while they
wait) is not dumped.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

from megalm.log import get_logger

logger = get_logger(__name__)


class HangWatchdog:
    """One rank's watchdog thread; :meth:`progress` marks progress, :meth:`close` stops it."""

    def __init__(self, seconds: float, rank: int, directory: Optional[str] = None):
        self.seconds = seconds
        self.rank = rank
        self.path = os.path.join(directory, f"rank_{rank}.txt") if directory else None
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.dumps = 0
        self._last = time.monotonic()
        self._where = "start of training"
        self._dumped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megalm-hang-watchdog", daemon=True)
        self._thread.start()

    def progress(self, where: str) -> None:
        """Training reached ``where`` (e.g. ``"iteration 12 started"``)."""
        self._where = where
        self._last = time.monotonic()
        self._dumped = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(1.0, self.seconds / 4)
        while not self._stop.wait(poll):
            stalled = time.monotonic() - self._last
            if stalled >= self.seconds and not self._dumped:
                self._dumped = True
                self._dump(stalled)

    def _dump(self, stalled: float) -> None:
        header = (
            f"[megalm rank {self.rank}] hang watchdog: no training progress for {stalled:.1f} s "
            f"(--hang-watchdog-seconds {self.seconds:g}; last progress: {self._where}); "
            f"Python stacks of this rank's threads:\n"
        )
        self.dumps += 1
        sys.stderr.write(header)
        sys.stderr.flush()
        try:
            faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
        except (AttributeError, OSError, ValueError):  # a replaced stderr without a descriptor
            faulthandler.dump_traceback(file=sys.__stderr__.fileno(), all_threads=True)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {header}")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            logger.warning(f"hang watchdog: stacks written to {self.path}")

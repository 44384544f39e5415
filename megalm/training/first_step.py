"""``--first-step-timeout-seconds S``: a rank that has not finished its first training step
``S`` seconds after set-up ended is named, and the job fails fast instead of waiting for the
collective timeout (``--distributed-timeout-minutes``, 10 minutes by default).

Every rank, when its set-up is done, writes ``first-step/started/<rank>`` = its host name to the
job's key-value store (torch.distributed's default store: torchrun's agent store, prefixed by the
restart attempt) and starts a daemon thread; it records the stage it reached in
``first-step/stage/<rank>`` (:data:`STAGES`: set-up done, first batch read, first step done) and,
after its first step, adds 1 to ``first-step/count``.  The thread sleeps ``S`` seconds (no
polling), then reads the count once: when every rank is done it ends; otherwise it reads the
stages of all ranks and logs one line naming the ranks that are behind (the earliest stage: a rank
whose DataLoader hangs never reads its first batch while its peers wait for it in the step's
gradient all-reduce) with their hosts and stage, then ends this process with
exit code :data:`EXIT_CODE` (``os._exit``: the main thread may be blocked in a collective or in a
DataLoader that will never return).  Every rank does this on its own, so a rank that waits for a
stuck peer fails as fast as the stuck rank; torchrun then restarts the job (``--max-restarts``)
or reports the failure.  The store is served by a C++ thread, so it answers even when the rank
hosting it is stuck in Python.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from typing import Callable, List

from megalm.log import get_logger

logger = get_logger(__name__)

EXIT_CODE = 75  # EX_TEMPFAIL: a restart may succeed
PREFIX = "first-step"
STAGES = ("set-up done", "first batch read", "first step done")


class FirstStepDeadline:
    """One rank's deadline thread.  ``store``: a ``torch.distributed.Store`` shared by the job's
    ranks; ``exit``: what ends the process (``os._exit``; tests pass a recorder)."""

    def __init__(self, seconds: float, store, rank: int, world: int, exit: Callable[[int], None] = os._exit) -> None:
        self.seconds, self.store, self.rank, self.world, self._exit = seconds, store, rank, world, exit
        self.message = None  # the error line, once the deadline passed with a rank missing
        self._done = False
        self._stop = threading.Event()
        store.set(f"{PREFIX}/started/{rank}", socket.gethostname())
        self.reached(STAGES[0])
        self._thread = threading.Thread(target=self._watch, name="megalm-first-step-deadline", daemon=True)
        self._thread.start()

    def reached(self, stage: str) -> None:
        """This rank reached ``stage`` (one of :data:`STAGES`; one store write)."""
        self.store.set(f"{PREFIX}/stage/{self.rank}", str(STAGES.index(stage)))

    def step_done(self) -> None:
        """This rank finished its first step (later calls do nothing)."""
        if self._done:
            return
        self._done = True
        self.reached(STAGES[2])
        self.store.add(f"{PREFIX}/count", 1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def stages(self) -> List[int]:
        """Every rank's stage (an index into :data:`STAGES`; -1: set-up not finished).  One store
        round trip per rank: only called at the deadline."""
        out = []
        for r in range(self.world):
            key = f"{PREFIX}/stage/{r}"
            out.append(int(self.store.get(key)) if self.store.check([key]) else -1)
        return out

    def _watch(self) -> None:
        if self._stop.wait(self.seconds):
            return
        try:
            if self.store.add(f"{PREFIX}/count", 0) >= self.world:
                return
            stages = self.stages()
            behind = [r for r, s in enumerate(stages) if s == min(stages)]
            hosts = [self._host(r) for r in behind]
        except Exception as e:  # the store is gone: the job is ending anyway
            logger.warning(f"first-step deadline: cannot read the store ({e}); not checking")
            return
        if min(stages) == len(STAGES) - 1:
            return
        stage = STAGES[min(stages)] if min(stages) >= 0 else "set-up not finished"
        named = ", ".join(f"rank {r} ({h})" for r, h in zip(behind, hosts))
        late = sum(s < len(STAGES) - 1 for s in stages)
        self.message = (
            f"{named} did not finish the first training step within {self.seconds:g} s of the end of set-up, "
            f"stuck after '{stage}' ({late} of {self.world} ranks not done, the others behind only them; "
            f"--first-step-timeout-seconds; this is rank {self.rank}): exiting with code {EXIT_CODE}"
        )
        logger.error(self.message)
        for handler in logging.getLogger("megalm").handlers + logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        self._exit(EXIT_CODE)

    def _host(self, rank: int) -> str:
        key = f"{PREFIX}/started/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else "set-up not finished"


def job_store():
    """The default process group's store (torchrun's agent store under a restart prefix, or the
    ``env://`` store): the only handle on it is torch's private accessor."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()

"""``--exit-signal-handler``: remember SIGTERM so the loop can finish the step, save and exit 0."""

from __future__ import annotations

import signal


class ExitSignalHandler:
    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self._received = False
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self._received = True

    def received(self) -> bool:
        return self._received

    def release(self) -> None:
        signal.signal(self.signum, self._previous)

"""megalm's one error base.

Library code raises a :class:`MegalmError` subclass naming the problem (a flag, a file, a rank);
only entry points (``pretrain_gpt.py``, ``tools/*``) turn errors into exit codes and messages.
Nothing inside ``megalm/`` raises ``SystemExit`` or calls ``sys.exit``.
"""

from __future__ import annotations


class MegalmError(Exception):
    """Base of every error megalm raises on purpose (bad config, data, checkpoint, conversion...)."""


class TrainingStopped(MegalmError):
    """Training stopped on purpose before its end, with ``exit_code`` for the entry point
    (e.g. 0 for ``--exit-signal-handler`` / ``--exit-duration-in-mins``)."""

    def __init__(self, message: str, exit_code: int = 0):
        super().__init__(message)
        self.exit_code = exit_code

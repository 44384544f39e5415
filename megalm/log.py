"""megalm's one logging channel: Python ``logging`` under the ``megalm`` logger, configured
once per process by the entry point with :func:`setup_logging`.

Every message carries the rank in its prefix (``[megalm rank 3] ...``), and a warning its level
(``[megalm rank 3] WARNING: ...``; an error's line is the entry point's ``error: ...``).  By
default INFO messages are shown on one rank only (``log_ranks``: rank 0, or the last rank for the
training log line, see :func:`get_logger`) and WARNING and above on every rank: a warning is
logged with ``logger.warning`` by every rank that has it (never as INFO with a "warning:"
prefix).  Library modules write ``logger = get_logger(__name__)`` and never ``print``.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

ROOT = "megalm"


class _RankFilter(logging.Filter):
    """Pass WARNING+ everywhere; INFO and below only on ``info_rank`` (or everywhere if None)."""

    def __init__(self, rank: int, info_rank: Optional[int]):
        super().__init__()
        self.rank, self.info_rank = rank, info_rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        if record.levelno >= logging.WARNING or self.info_rank is None:
            return True
        wanted = getattr(record, "on_rank", self.info_rank)
        return wanted is None or wanted == self.rank


class _LevelFormatter(logging.Formatter):
    """``prefix WARNING: message`` for a warning; ``prefix message`` otherwise (an error's line is the
    entry point's ``error: ...``)."""

    def __init__(self, prefix: str):
        super().__init__(prefix + "%(message)s")
        self._leveled = logging.Formatter(prefix + "%(levelname)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return self._leveled.format(record) if record.levelno == logging.WARNING else super().format(record)


class _StdHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` or ``sys.stderr`` as they are at each record (not as they were
    at setup), so a replaced stream (pytest's capture, a redirect) still gets the messages."""

    def __init__(self, name: str):
        logging.Handler.__init__(self)
        self._name = name

    @property
    def stream(self):
        return getattr(sys, self._name)


def setup_logging(
    rank: int = 0, world_size: int = 1, info_rank: Optional[int] = 0, level: int = logging.INFO, stream="stdout"
) -> logging.Logger:
    """Configure the ``megalm`` logger for this process (idempotent: replaces its handler).

    ``stream``: ``"stdout"`` (training logs, as Megatron prints them), ``"stderr"`` (command-line
    tools, whose stdout is their result) or a file object.  ``info_rank`` None shows INFO on
    every rank.  A record may name its rank with ``logger.info(msg, extra={"on_rank": world_size - 1})``
    (Megatron's ``print_rank_last``).
    """
    logger = logging.getLogger(ROOT)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    if stream is None or stream in ("stdout", "stderr"):
        handler = _StdHandler(stream or "stdout")
    else:
        handler = logging.StreamHandler(stream)
    prefix = "[megalm rank %(rank)d] " if world_size > 1 else "[megalm] "
    handler.setFormatter(_LevelFormatter(prefix))
    handler.addFilter(_RankFilter(rank, info_rank))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger for a megalm module (a child of ``megalm``)."""
    if name != ROOT and not name.startswith(ROOT + "."):
        name = f"{ROOT}.{name}"
    return logging.getLogger(name)

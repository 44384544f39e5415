"""Tests that read megalm's log: configure the ``megalm`` logger for one test, then put it back.

``setup_logging`` stops propagation to the root logger (where pytest's own handlers sit), so
a test that wants to see the messages configures the channel itself::

    with megalm_logs("stderr"):
        ...
    assert "..." in capsys.readouterr().err
"""

from __future__ import annotations

import contextlib
import logging

from megalm.log import ROOT, setup_logging


@contextlib.contextmanager
def megalm_logs(stream="stderr", rank: int = 0, world_size: int = 1, **kwargs):
    logger = logging.getLogger(ROOT)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    setup_logging(rank, world_size, stream=stream, **kwargs)
    try:
        yield logger
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        handlers, level, propagate = saved
        for handler in handlers:
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate

"""``megalm-plan`` (``python tools/plan.py``): the layout planner, the fastest parallel layouts of a
model on a cluster with the flags to run them; see :mod:`megalm.planner.cli` and docs/planner.md.
Errors (bad flags, a bad cluster file) exit with status 2; no layout fits: 1."""

from __future__ import annotations

import sys

from megalm.errors import MegalmError, TrainingStopped
from megalm.log import get_logger, setup_logging
from megalm.planner.cli import main as plan_main


def main(argv=None) -> int:
    setup_logging(stream=sys.stderr)
    try:
        return plan_main(argv)
    except TrainingStopped as e:  # --help
        return e.exit_code
    except MegalmError as e:
        get_logger(__name__).error("error: %s", e)
        return 2

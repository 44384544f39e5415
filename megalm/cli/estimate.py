"""``megalm-estimate`` (``python tools/estimate.py``): the memory and speed planner; see
:mod:`megalm.estimate.cli` for what it prints.  Errors (an unknown preset, flags that do not
validate) exit with status 2."""

from __future__ import annotations

import sys

from megalm.errors import MegalmError, TrainingStopped
from megalm.estimate.cli import main as plan_main
from megalm.log import get_logger, setup_logging


def main(argv=None) -> int:
    setup_logging(stream=sys.stderr)
    try:
        return plan_main(argv)
    except TrainingStopped as e:  # --help
        return e.exit_code
    except MegalmError as e:
        get_logger(__name__).error("error: %s", e)
        return 2

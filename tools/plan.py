#!/usr/bin/env python
"""Layout planner: the fastest parallel layouts of a model on a cluster, with the flags to run them.

    python3 tools/plan.py --preset llama3_8b --cluster h100 --nodes 8
    python3 tools/plan.py <pretrain_gpt.py model flags> --global-batch-size 64 --cluster cluster.toml
    python3 tools/plan.py --cluster sim.toml --calibrate --nodes 2 --devices-per-node 2 --inter-node-rate 1gbit

See docs/planner.md.  Errors (bad flags, a bad cluster file) exit with status 2; no layout fits: 1.
"""

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megalm.errors import MegalmError, TrainingStopped  # noqa: E402
from megalm.log import get_logger, setup_logging  # noqa: E402
from megalm.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    setup_logging(stream=sys.stderr)
    try:
        sys.exit(main())
    except TrainingStopped as e:  # --help
        sys.exit(e.exit_code)
    except MegalmError as e:
        get_logger("tools.plan").error("error: %s", e)
        sys.exit(2)

#!/usr/bin/env python
"""``python tools/plan.py``: the ``megalm-plan`` command (:mod:`megalm.cli.plan`), for scripts that
call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``).

    python3 tools/plan.py --preset llama3_8b --cluster h100 --nodes 8
    python3 tools/plan.py <pretrain_gpt.py model flags> --global-batch-size 64 --cluster cluster.toml
    python3 tools/plan.py --cluster sim.toml --calibrate --nodes 2 --devices-per-node 2 --inter-node-rate 1gbit

See docs/planner.md.  Errors (bad flags, a bad cluster file) exit with status 2; no layout fits: 1.
"""

import sys

from megalm.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())

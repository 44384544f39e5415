#!/usr/bin/env python
"""``python tools/cluster/run.py``: the ``megalm-cluster`` command (:mod:`megalm.cli.cluster`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.cli.cluster import main

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""``python tools/estimate.py``: the ``megalm-estimate`` command (:mod:`megalm.cli.estimate`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.cli.estimate import main

if __name__ == "__main__":
    sys.exit(main())

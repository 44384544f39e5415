#!/usr/bin/env python
"""``python tools/generate.py``: the ``megalm-generate`` command (:mod:`megalm.cli.generate`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())

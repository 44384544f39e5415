#!/usr/bin/env python
"""``python tools/preprocess_data.py``: the ``megalm-preprocess`` command (:mod:`megalm.cli.preprocess_data`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.cli.preprocess_data import main

if __name__ == "__main__":
    sys.exit(main())

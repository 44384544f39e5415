#!/usr/bin/env python
"""``python tools/presets.py``: the ``megalm-presets`` command (:mod:`megalm.presets.cli`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.presets.cli import main

if __name__ == "__main__":
    sys.exit(main())

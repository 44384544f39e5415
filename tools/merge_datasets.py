#!/usr/bin/env python
"""``python tools/merge_datasets.py``: the ``megalm-merge-datasets`` command (:mod:`megalm.cli.merge_datasets`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.cli.merge_datasets import main

if __name__ == "__main__":
    sys.exit(main())

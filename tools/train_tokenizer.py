#!/usr/bin/env python
"""``python tools/train_tokenizer.py``: the ``megalm-train-tokenizer`` command (:mod:`megalm.cli.train_tokenizer`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import sys

from megalm.cli.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())

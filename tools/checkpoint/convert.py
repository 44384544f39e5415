#!/usr/bin/env python
"""``python tools/checkpoint/convert.py``: the ``megalm-convert`` command (:mod:`megalm.cli.convert`),
for scripts that call the tool by path.  megalm must be installed (``tools/install.sh``: ``pip install -e .``)."""

import os
import sys

# tools/checkpoint/ holds inspect.py: run as a script, this directory is sys.path[0] and the file
# would shadow the standard library's inspect module (imported by torch).  Dropping it is the one
# sys.path change here; megalm itself comes from the installed package (tools/install.sh).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

from megalm.cli.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

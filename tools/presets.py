#!/usr/bin/env python
"""Model presets on the command line: list them, print one's pretrain_gpt.py flags, or the bash that
``scripts/common.sh`` evaluates (see megalm/presets/cli.py).

    python3 tools/presets.py                  # list the presets
    python3 tools/presets.py NAME             # its pretrain_gpt.py flags, one per line
    python3 tools/presets.py NAME --shell     # bash assignments with the environment's overrides
    python3 tools/presets.py --table          # the table of scripts/README.md
"""

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if _ROOT not in sys.path:  # once, however often the tool is run in one process (runpy)
    sys.path.insert(0, _ROOT)

from megalm.presets.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

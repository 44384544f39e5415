#!/usr/bin/env python
"""Memory and speed planner: per-GPU bytes and step time of a training layout, before launching it.

    python tools/estimate.py <pretrain_gpt.py flags> [--world-size N] [--gpu-memory-gb 80] \\
        [--mfu 0.4] [--device h100|h100-pcie|h200|a100|cpu] [--reserve-gb 4] [--json]
    python tools/estimate.py --preset NAME [flags that override the preset's]

Takes the same flags as pretrain_gpt.py (validated the same way) and prints, per pipeline
rank: parameters, bytes of weights / gradients / optimizer state with and without the
distributed optimizer, activations per microbatch (with the configured recompute) times the
microbatches the 1F1B / interleaved schedule keeps in flight, and whether the largest rank
fits; then FLOPs per iteration and the expected step time at the given MFU.  Formulas:
megalm/estimate/ (planner.py, activations.py, parameters.py).

``--preset NAME`` (``python3 tools/presets.py`` lists the names) plans what
``scripts/pretrain_NAME.sh`` runs by default, on its default number of GPUs:

    python tools/estimate.py --preset llama2_7b
    python tools/estimate.py --preset llama2_7b --tensor-model-parallel-size 2   # a smaller TP
    python tools/estimate.py --preset gpt3_175b --world-size 256                 # DP 2

Errors (an unknown preset, flags that do not validate) exit with status 2.
"""

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
if _ROOT not in sys.path:  # once, however often the tool is run in one process (runpy)
    sys.path.insert(0, _ROOT)

from megalm.errors import MegalmError, TrainingStopped  # noqa: E402
from megalm.estimate.cli import main  # noqa: E402
from megalm.log import get_logger, setup_logging  # noqa: E402

if __name__ == "__main__":
    setup_logging(stream=sys.stderr)
    try:
        sys.exit(main())
    except TrainingStopped as e:  # --help
        sys.exit(e.exit_code)
    except MegalmError as e:
        get_logger("tools.estimate").error("error: %s", e)
        sys.exit(2)

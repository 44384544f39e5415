#!/usr/bin/env python
"""Memory and speed planner: per-GPU bytes and step time of a training layout, before launching it.

    python tools/estimate.py <pretrain_gpt.py flags> [--world-size N] [--gpu-memory-gb 80] \\
        [--mfu 0.4] [--device h100|h100-pcie|h200|a100|cpu] [--reserve-gb 4] [--json]

Takes the same flags as pretrain_gpt.py (validated the same way) and prints, per pipeline
rank: parameters, bytes of weights / gradients / optimizer state with and without the
distributed optimizer, activations per microbatch (with the configured recompute) times the
microbatches the 1F1B / interleaved schedule keeps in flight, and whether the largest rank
fits; then FLOPs per iteration and the expected step time at the given MFU.  Formulas:
megalm/estimate/ (planner.py, activations.py, parameters.py).

    DRY_RUN=1 scripts/pretrain_llama2_7b.sh | sed -n '/^---- pretrain_gpt.py flags ----$/,$p' | tail -n +2 \\
        | xargs python tools/estimate.py --world-size 8
"""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megalm.estimate.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Why ``--grad-compression int4`` stays refused across torchft replica groups: its levels per group.

    python3 bench/torchft_int4_levels.py

torchft's fault-tolerant collective is an all-reduce, so a group's codes must add up in flight: with
a shared per-chunk scale (as int8 across groups, :mod:`megalm.resilience.torchft_compression`) the
sum of ``G`` groups' codes must fit the code's range, so each group gets ``L = 127 // G`` levels a
side in int8 and ``L = 7 // G`` in int4 (packed nibbles in offset binary: the same count).  This
runs :class:`~megalm.resilience.torchft_compression.CrossGroupInt8` (error feedback, nearest
rounding, chunk 1024) with ``L`` set to each case, ``G`` groups as threads, 20 steps of Gaussian
gradients of 65536 elements per group, and prints the relative error of the averaged gradient
(one step; the mean over the 20 steps with error feedback) and of the 20 steps' sum.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main():
    import torch

    from megalm.resilience.torchft_compression import CrossGroupInt8
    from tests.test_torchft_compression import FakeQuorum

    torch.manual_seed(0)
    n = 1 << 16
    print("| code | groups | levels a side | one step | mean of 20 steps (error feedback) | sum of 20 steps |")
    print("|---|---|---|---|---|---|")
    for code, groups, levels in [("int8", 2, 63), ("int8", 8, 15), ("int4", 2, 3), ("int4", 4, 1)]:
        quorum = FakeQuorum(groups)
        comps = [CrossGroupInt8(chunk=1024, max_groups=groups) for _ in range(groups)]
        for c in comps:
            c.levels = levels
        errors, exact_total, sent_total = [], torch.zeros(n), torch.zeros(n)
        for _ in range(20):
            grads = [[torch.randn(n)] for _ in range(groups)]
            exact = sum(g[0] for g in grads) / groups
            quorum.run(comps, grads)
            for c in comps:
                c.commit()
            errors.append(float((grads[0][0] - exact).norm() / exact.norm()))
            exact_total += exact
            sent_total += grads[0][0]
        total = float((sent_total - exact_total).norm() / exact_total.norm())
        print(f"| {code} | {groups} | {levels} | {errors[0]:.3f} | {sum(errors) / 20:.3f} | {total:.4f} |")
    print("| int4 | 8 | 0 | (no level left) | | |")


if __name__ == "__main__":
    main()

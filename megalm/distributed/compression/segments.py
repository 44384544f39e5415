"""Which parts of a flat gradient range are matrices: the unit PowerSGD compresses.

A bucket (or, under ``--hierarchical-grad-reduce``, this rank's ``1/L`` chunk of it) is a range
``[lo, hi)`` of a buffer in which parameters sit row-major one after the other.  A 2-D parameter
``[n, m]`` starting at ``s`` contributes the whole rows inside the range as a matrix
``[rows, m]``; the partial rows at either edge and every other parameter (vectors, norms, biases)
are plain elements.  The split depends only on the buffer layout and the range, so every rank of
a reducing group computes the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple


@dataclass(frozen=True)
class Segment:
    """``[start, end)`` relative to the range; ``shape`` is ``(rows, cols)`` for a matrix, else None."""

    start: int
    end: int
    shape: Optional[Tuple[int, int]] = None


def matrix_segments(params: Iterable[Tuple[int, int, tuple]], lo: int, hi: int) -> List[Segment]:
    """The matrices of ``[lo, hi)`` (``params``: ``(start, end, shape)`` in the same coordinates);
    only matrices are listed, the rest of the range is the plain remainder."""
    out = []
    for start, end, shape in params:
        if len(shape) != 2 or end <= lo or start >= hi:
            continue
        cols = shape[1]
        first = start + -(-(max(start, lo) - start) // cols) * cols  # first whole row inside
        last = start + ((min(end, hi) - start) // cols) * cols
        if last - first >= cols:
            out.append(Segment(first - lo, last - lo, ((last - first) // cols, cols)))
    return sorted(out, key=lambda s: s.start)


def remainder_mask_indices(numel: int, matrices: List[Segment]):
    """``(start, end)`` spans of ``[0, numel)`` not covered by ``matrices`` (in order)."""
    spans, cursor = [], 0
    for s in matrices:
        if s.start > cursor:
            spans.append((cursor, s.start))
        cursor = s.end
    if cursor < numel:
        spans.append((cursor, numel))
    return spans

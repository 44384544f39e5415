"""``--split "969,30,1"``: the train/valid/test proportions, and the documents each split takes.

Parsed as Megatron's parser does: the numbers in the string, so the literal quotes Megatron's example
scripts pass (``--split "'99,1,0'"``) work, and ``/`` separates as well as ``,``.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from megalm.config.data import split_fractions
from megalm.data.indexed_dataset import DataError


def parse_split(split: str) -> List[float]:
    """``"969,30,1"`` -> normalized ``[train, valid, test]`` fractions (missing ones are 0); a bad
    string raises :class:`DataError` (the parser is the config's, which checks the flag first)."""
    return split_fractions(split, DataError)


def split_document_ranges(num_documents: int, split: Sequence[float]) -> List[Tuple[int, int]]:
    """Document ``[begin, end)`` of each split: ``round(cumulative fraction x documents)``."""
    bounds = np.concatenate(([0.0], np.cumsum(split)))
    edges = [int(round(b * num_documents)) for b in bounds]
    edges[-1] = num_documents
    return [(edges[i], edges[i + 1]) for i in range(3)]

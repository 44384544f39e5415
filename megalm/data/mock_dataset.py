"""Deterministic synthetic documents for ``--mock-data`` (no files needed).

Document ``i`` has a seeded random length in ``[1, max_length]``; its tokens count up from
a seeded start (wrapping, skipping the end-of-document id) and its last token is the
end-of-document id, so models can learn something and tests can predict every token.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from megalm.data.indexed_dataset import DataError


class MockIndexedDataset:
    """Same reading interface as :class:`IndexedDataset` (``sequence_lengths``, ``get``)."""

    path_prefix = None

    def __init__(self, vocab_size: int, eod: int, num_documents: int = 16384, max_length: int = 1024, seed: int = 0):
        if vocab_size < 2:
            raise DataError(f"--mock-data needs a vocabulary of at least 2 ids (--vocab-size), got {vocab_size}")
        if not 0 <= eod < vocab_size:
            raise DataError(f"end-of-document id {eod} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size, self.eod = int(vocab_size), int(eod)
        self.num_documents, self.max_length, self.seed = int(num_documents), int(max_length), int(seed)
        rng = np.random.default_rng(seed)
        self.sequence_lengths = rng.integers(1, max_length + 1, size=num_documents, dtype=np.int32)
        self._starts = rng.integers(0, vocab_size - 1, size=num_documents, dtype=np.int64)
        self.document_indices = np.arange(num_documents + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_documents

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) is outside mock document {idx} of length {size}")
        positions = np.arange(offset, offset + length, dtype=np.int64)
        ids = (self._starts[idx] + positions) % (self.vocab_size - 1)
        ids = ids + (ids >= self.eod)  # skip the end-of-document id
        ids[positions == size - 1] = self.eod
        return ids

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def __repr__(self) -> str:
        return (
            f"MockIndexedDataset(vocab_size={self.vocab_size}, eod={self.eod}, num_documents={self.num_documents}, "
            f"max_length={self.max_length}, seed={self.seed})"
        )

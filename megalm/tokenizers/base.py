"""The tokenizer interface every part of megalm relies on.

A tokenizer turns text into a list of integer ids and back, and names the special ids the
data pipeline needs: ``eod`` (appended after every document by preprocessing, masked from
the loss with ``--eod-mask-loss``) and ``pad`` (``-1`` when the vocabulary has none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Sequence

from megalm.errors import MegalmError


class TokenizerError(MegalmError, ValueError):
    """A tokenizer that cannot be built from the flags given (flag missing, file unusable), or text it
    cannot take."""


class Tokenizer(ABC):
    """Abstract tokenizer; subclasses wrap a concrete library."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the embedding must cover (before padding to a multiple)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id."""

    @property
    def pad(self) -> int:
        """Padding id, or -1 when the vocabulary defines none."""
        return -1

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Ids of ``text`` (no end-of-document id appended)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of each text; subclasses override with a faster batched call."""
        return [self.tokenize(t) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"

"""Tokenizer for text that is already ids, as Megatron-LM's ``NullTokenizer``.

``--vocab-size V`` declares ids ``0..V-1``; the end-of-document id is ``V`` itself, so the
tokenizer's ``vocab_size`` is ``V + 1`` and ``eod == vocab_size - 1`` (Megatron's layout).
"""

from __future__ import annotations

from typing import List, Sequence

from megalm.tokenizers.base import Tokenizer, TokenizerError


class NullTokenizer(Tokenizer):
    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}")
        self._ids = int(vocab_size)

    @staticmethod
    def ids_for(tokenizer_vocab_size: int) -> int:
        """The ``--vocab-size`` whose tokenizer has ``vocab_size == tokenizer_vocab_size`` (the
        value a checkpoint's config records)."""
        return int(tokenizer_vocab_size) - 1

    @property
    def vocab_size(self) -> int:
        return self._ids + 1

    @property
    def eod(self) -> int:
        return self._ids

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise TokenizerError(f"NullTokenizer expects space-separated integers, got {text[:60]!r}") from None
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"NullTokenizer: id {i} is outside [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

"""SentencePiece tokenizer, as Megatron-LM's ``GPTSentencePieceTokenizer``.

The vocabulary is the model's pieces; the end-of-document id is the model's ``eos_id()``
(Megatron appends exactly this id after each document), padding its ``pad_id()``.
"""

from __future__ import annotations

import os
from typing import List, Sequence

from megalm.tokenizers.base import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str, num_threads: int = 1):
        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-model {model_file!r}: sentencepiece model file not found")
        import sentencepiece as spm

        self.model_file = model_file
        self.num_threads = num_threads
        self._sp = spm.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {model_file} has no end-of-sentence piece (eos_id = -1); "
                             f"megalm uses eos as the end-of-document id: retrain with --eos_id >= 0")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), num_threads=self.num_threads)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self):
        return {"model_file": self.model_file, "num_threads": self.num_threads}

    def __setstate__(self, state):
        self.__init__(state["model_file"], state["num_threads"])

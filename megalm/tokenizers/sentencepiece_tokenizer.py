"""SentencePiece tokenizers, as Megatron-LM's ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer``.

The vocabulary is the model's pieces; the end-of-document id is the model's ``eos_id()``
(Megatron appends exactly this id after each document), padding its ``pad_id()``.
``Llama2Tokenizer`` also puts the model's ``bos_id()`` before every encoded text, as Llama-2
was trained and as Megatron's ``Llama2Tokenizer`` does, so a preprocessed Llama document
is ``<s> text </s>``.  (Megatron's ``SentencePieceTokenizer`` adds BERT-style special
tokens beyond the model's vocabulary; megalm's name means the plain GPT one.)
"""

from __future__ import annotations

import os
from typing import List, Sequence

from megalm.tokenizers.base import Tokenizer, TokenizerError


class SentencePieceTokenizer(Tokenizer):
    add_bos = False

    def __init__(self, model_file: str, num_threads: int = 1):
        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"--tokenizer-model {model_file!r}: sentencepiece model file not found")
        import sentencepiece as spm

        self.model_file = model_file
        self.num_threads = num_threads
        self._sp = spm.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise TokenizerError(
                f"sentencepiece model {model_file} has no end-of-sentence piece (eos_id = -1); "
                f"megalm uses eos as the end-of-document id: retrain with --eos_id >= 0"
            )
        if self.add_bos and self._sp.bos_id() < 0:
            raise TokenizerError(
                f"sentencepiece model {model_file} has no beginning-of-sentence piece (bos_id = -1), "
                f"which {type(self).__name__} puts before every text"
            )

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
        return self._sp.encode(text, add_bos=self.add_bos)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), add_bos=self.add_bos, num_threads=self.num_threads)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __getstate__(self):
        return {"model_file": self.model_file, "num_threads": self.num_threads}

    def __setstate__(self, state):
        self.__init__(state["model_file"], state["num_threads"])


class Llama2Tokenizer(SentencePieceTokenizer):
    """SentencePiece with the model's BOS id before every text (Megatron-LM's ``Llama2Tokenizer``)."""

    add_bos = True

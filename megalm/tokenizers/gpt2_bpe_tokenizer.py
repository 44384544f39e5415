"""GPT-2 byte-level BPE from ``--vocab-file`` / ``--merge-file``, as Megatron-LM's ``GPT2BPETokenizer``.

The files are OpenAI's GPT-2 pair (``gpt2-vocab.json``: token -> id, ``gpt2-merges.txt``:
one merge per line in rank order after a ``#version`` header), or any pair in that format.
Encoding is GPT-2's: text is split with GPT-2's pre-tokenizer regex, each piece's UTF-8
bytes are mapped to printable characters, and merges are applied lowest rank first.  The
``tokenizers`` library does the work.

As in Megatron-LM: ``vocab_size`` is the number of entries in the vocab file (50257 for
GPT-2), ``eod`` is the id of ``<|endoftext|>``, there is no padding id, and
``<|endoftext|>`` written in a document is encoded as ordinary text (no special tokens are
recognised).  Decoding replaces invalid UTF-8 with U+FFFD (Megatron's ``errors='replace'``).
Encoding and decoding are :class:`HuggingFaceTokenizer`'s, over a tokenizer built from the two files.
"""

from __future__ import annotations

import json
import os

from megalm.tokenizers.base import TokenizerError
from megalm.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer

EOD_TOKEN = "<|endoftext|>"


def _read_vocab(vocab_file: str) -> dict:
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"--vocab-file {vocab_file}: not a GPT-2 vocab.json ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {vocab_file}: expected a JSON object mapping tokens to integer ids")
    return vocab


class GPT2BPETokenizer(HuggingFaceTokenizer):
    # HuggingFaceTokenizer.__init__ (which reads a tokenizer.json) is replaced, not extended.
    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"{flag} {path!r}: GPT-2 BPE file not found")
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self.vocab_file, self.merge_file = vocab_file, merge_file
        vocab = _read_vocab(vocab_file)
        if EOD_TOKEN not in vocab:
            raise TokenizerError(
                f"--vocab-file {vocab_file}: no {EOD_TOKEN} entry (GPT2BPETokenizer's end-of-document token)"
            )
        missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
        if missing:
            raise TokenizerError(
                f"--vocab-file {vocab_file}: {len(missing)} of the 256 byte symbols are missing "
                f"(e.g. {missing[0]!r}); text using those bytes could not be encoded"
            )
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust reader names the bad line
            raise TokenizerError(f"--merge-file {merge_file}: not a GPT-2 merges file for {vocab_file} ({e})") from None
        self._tok = _HFTokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        self._hf = None
        self._vocab_size, self._eod, self._pad = len(vocab), vocab[EOD_TOKEN], -1

    def save_tokenizer_json(self, path: str) -> None:
        """Write the same tokenizer as one Hugging Face ``tokenizer.json``."""
        self._tok.save(path)

    def __getstate__(self):
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file}

    def __setstate__(self, state):
        self.__init__(state["vocab_file"], state["merge_file"])

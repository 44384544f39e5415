"""Hugging Face tokenizer from local files only (never the hub).

``--tokenizer-model`` is a ``tokenizer.json`` file or a directory holding one (with an
optional ``tokenizer_config.json`` / ``special_tokens_map.json`` naming the special
tokens).  It is loaded with the ``tokenizers`` library; a directory without
``tokenizer.json`` is loaded with ``transformers`` (``local_files_only=True``) when that is
installed.  As Megatron-LM's ``HuggingFaceTokenizer``: ``vocab_size`` counts added tokens,
``eod`` is the end-of-sequence token, and encoding adds the tokenizer's own special tokens
(e.g. a BOS from its post-processor).
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

from megalm.tokenizers.base import Tokenizer, TokenizerError

# Tried in order when the tokenizer's files name no end-of-sequence token.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


def _token_content(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens_from_files(directory: str) -> dict:
    """``{"eos_token": ..., "pad_token": ...}`` from tokenizer_config.json / special_tokens_map.json."""
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            for key in ("eos_token", "pad_token", "bos_token"):
                content = _token_content(cfg.get(key))
                if content is not None:
                    found[key] = content
    return found


class HuggingFaceTokenizer(Tokenizer):
    def __init__(self, path: str):
        if not path or not os.path.exists(path):
            raise FileNotFoundError(
                f"--tokenizer-model {path!r}: no tokenizer.json file or directory there "
                f"(megalm loads Hugging Face tokenizers from local files only)"
            )
        self.path = path
        directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        json_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        special = _special_tokens_from_files(directory)
        if os.path.isfile(json_file):
            self._init_tokenizers(json_file, special)
        else:
            self._init_transformers(path)

    # -- backends -------------------------------------------------------------------------
    def _init_tokenizers(self, json_file: str, special: dict) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self._tok = _HFTokenizer.from_file(json_file)
        self._hf = None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = special.get("eos_token")
        if eos is None:
            eos = next((c for c in _EOS_CANDIDATES if c in vocab), None)
        if eos is None or eos not in vocab:
            raise TokenizerError(
                f"Hugging Face tokenizer {json_file}: no end-of-sequence token found (looked for "
                f"eos_token in tokenizer_config.json/special_tokens_map.json and {_EOS_CANDIDATES}); "
                f'add "eos_token" to tokenizer_config.json'
            )
        self._eod = vocab[eos]
        pad = special.get("pad_token")
        if pad in vocab:
            self._pad = vocab[pad]
        elif self._tok.padding is not None:
            self._pad = self._tok.padding["pad_id"]
        else:
            self._pad = -1

    def _init_transformers(self, directory: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise FileNotFoundError(
                f"--tokenizer-model {directory!r} has no tokenizer.json and transformers is not "
                f"installed to load its other files"
            ) from None
        self._hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self._tok = None
        if self._hf.eos_token_id is None:
            raise TokenizerError(f"Hugging Face tokenizer {directory} defines no eos_token")
        self._vocab_size = len(self._hf)
        self._eod = self._hf.eos_token_id
        self._pad = self._hf.pad_token_id if self._hf.pad_token_id is not None else -1

    # -- interface ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> List[int]:
        if self._tok is not None:
            return self._tok.encode(text).ids
        return self._hf(text).input_ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if self._tok is not None:
            return [e.ids for e in self._tok.encode_batch(list(texts))]
        return self._hf(list(texts)).input_ids

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=False) if self._tok is not None else self._hf.decode(ids)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

"""Build the tokenizer named by ``--tokenizer-type``."""

from __future__ import annotations

from typing import Optional

from megalm.tokenizers.base import Tokenizer

TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def create_tokenizer(tokenizer_type: Optional[str], tokenizer_model: Optional[str] = None,
                     vocab_size: Optional[int] = None) -> Tokenizer:
    """Tokenizer from plain values (used by the tools, which have no full config)."""
    if tokenizer_type == "SentencePieceTokenizer":
        from megalm.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

        if tokenizer_model is None:
            raise ValueError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model <file.model>")
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        from megalm.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer

        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model <tokenizer.json or dir>")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        from megalm.tokenizers.null_tokenizer import NullTokenizer

        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(data_cfg, model_cfg) -> Tokenizer:
    """Tokenizer for a :class:`megalm.config.DataConfig` / :class:`megalm.config.ModelConfig` pair.

    The model's ``--vocab-size`` is read only by ``NullTokenizer``; record the returned
    tokenizer's ``vocab_size`` with :func:`megalm.config.set_vocab_size`.
    """
    return create_tokenizer(data_cfg.tokenizer_type, data_cfg.tokenizer_model, model_cfg.vocab_size)

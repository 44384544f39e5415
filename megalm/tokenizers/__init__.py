"""Tokenizers: one interface (:class:`Tokenizer`) over sentencepiece, Hugging Face and raw ids."""

from megalm.tokenizers.base import Tokenizer
from megalm.tokenizers.build import TOKENIZER_TYPES, build_tokenizer, create_tokenizer
from megalm.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megalm.tokenizers.null_tokenizer import NullTokenizer
from megalm.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

__all__ = ["Tokenizer", "TOKENIZER_TYPES", "build_tokenizer", "create_tokenizer", "HuggingFaceTokenizer",
           "NullTokenizer", "SentencePieceTokenizer"]

"""Tokenizers: one interface (:class:`Tokenizer`) over GPT-2 BPE, sentencepiece, Hugging Face and raw ids."""

from megalm.tokenizers.base import Tokenizer
from megalm.tokenizers.build import TOKENIZER_TYPES, build_tokenizer, create_tokenizer, missing_tokenizer_flags
from megalm.tokenizers.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megalm.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megalm.tokenizers.null_tokenizer import NullTokenizer
from megalm.tokenizers.sentencepiece_tokenizer import Llama2Tokenizer, SentencePieceTokenizer

__all__ = [
    "Tokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "create_tokenizer",
    "missing_tokenizer_flags",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
]

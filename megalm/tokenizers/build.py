"""Build the tokenizer named by ``--tokenizer-type`` (Megatron-LM's names).

Missing flags, missing files and files that do not load raise :class:`TokenizerError`
(a :class:`~megalm.errors.MegalmError`) with a one-line message naming the flag and path.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from megalm.errors import MegalmError
from megalm.tokenizers.base import Tokenizer, TokenizerError  # TokenizerError: re-exported

# --tokenizer-type -> the (argument, flag) pairs it needs.
_NEEDS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "GPT2BPETokenizer": (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")),
    "SentencePieceTokenizer": (("tokenizer_model", "--tokenizer-model"),),
    "GPTSentencePieceTokenizer": (("tokenizer_model", "--tokenizer-model"),),
    "Llama2Tokenizer": (("tokenizer_model", "--tokenizer-model"),),
    "HuggingFaceTokenizer": (("tokenizer_model", "--tokenizer-model"),),
    "NullTokenizer": (("vocab_size", "--vocab-size"),),
}
TOKENIZER_TYPES = tuple(_NEEDS)
# Types whose --tokenizer-model is a sentencepiece .model file.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


class TokenizerFileError(TokenizerError, FileNotFoundError):
    """A tokenizer file named by a flag does not exist."""


def _check_files(tokenizer_type: str, **given) -> None:
    """Raise :class:`TokenizerFileError` for the first file flag that names no file.

    ``--tokenizer-model`` of a Hugging Face tokenizer may be a directory; every other file
    flag must name a file.
    """
    for arg, flag in _NEEDS[tokenizer_type]:
        path = given.get(arg)
        if arg == "vocab_size" or path is None:
            continue
        ok = os.path.exists(path) if tokenizer_type == "HuggingFaceTokenizer" else os.path.isfile(path)
        if not ok:
            what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
            raise TokenizerFileError(f"{flag} {path} {what} (needed by --tokenizer-type {tokenizer_type})")


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def missing_tokenizer_flags(tokenizer_type: str, **given) -> List[str]:
    """The flags ``tokenizer_type`` needs that are None in ``given`` (keyword = argument name)."""
    return [flag for arg, flag in _NEEDS.get(tokenizer_type, ()) if given.get(arg) is None]


def create_tokenizer(
    tokenizer_type: Optional[str],
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> Tokenizer:
    """Tokenizer from plain values (used by the tools, which have no full config)."""
    if tokenizer_type not in _NEEDS:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")
    given = {
        "tokenizer_model": tokenizer_model,
        "vocab_size": vocab_size,
        "vocab_file": vocab_file,
        "merge_file": merge_file,
    }
    missing = missing_tokenizer_flags(tokenizer_type, **given)
    if missing:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {' and '.join(missing)}")
    _check_files(tokenizer_type, **given)
    try:
        return _construct(tokenizer_type, tokenizer_model, vocab_size, vocab_file, merge_file)
    except MegalmError as e:
        if not isinstance(e, TokenizerError):
            raise
        source = tokenizer_model or vocab_file or vocab_size  # the class's refusal, named with the flag
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} ({source}): {_one_line(e)}") from e
    except (OSError, RuntimeError, ValueError) as e:  # a file that exists but does not load
        source = tokenizer_model or vocab_file or vocab_size
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} ({source}): {_one_line(e)}") from e


def _construct(tokenizer_type: str, tokenizer_model, vocab_size, vocab_file, merge_file) -> Tokenizer:
    if tokenizer_type == "GPT2BPETokenizer":
        from megalm.tokenizers.gpt2_bpe_tokenizer import GPT2BPETokenizer

        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        from megalm.tokenizers.sentencepiece_tokenizer import Llama2Tokenizer, SentencePieceTokenizer

        return (Llama2Tokenizer if tokenizer_type == "Llama2Tokenizer" else SentencePieceTokenizer)(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        from megalm.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(tokenizer_model)
    from megalm.tokenizers.null_tokenizer import NullTokenizer

    return NullTokenizer(vocab_size)


def build_tokenizer(data_cfg, model_cfg) -> Tokenizer:
    """Tokenizer for a :class:`megalm.config.DataConfig` / :class:`megalm.config.ModelConfig` pair.

    The model's ``--vocab-size`` is read only by ``NullTokenizer``; record the returned
    tokenizer's ``vocab_size`` with :func:`megalm.config.set_vocab_size`.
    """
    return create_tokenizer(
        data_cfg.tokenizer_type,
        data_cfg.tokenizer_model,
        model_cfg.vocab_size,
        data_cfg.vocab_file,
        data_cfg.merge_file,
    )

"""Carry the tokenizer across a conversion.

Export (megalm -> HF directory), from the saved config's data section:

* ``GPT2BPETokenizer``: ``vocab.json`` and ``merges.txt`` are copied and the same tokenizer
  is written as ``tokenizer.json``; ``tokenizer_config.json`` names ``GPT2Tokenizer`` with
  ``<|endoftext|>`` as BOS/EOS (Hugging Face then reads that string in text as one special
  token, where Megatron's GPT-2 tokenizer spells it out).
* ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer``:
  ``tokenizer.model`` is copied and ``tokenizer_config.json`` names ``LlamaTokenizer``,
  adding a BOS only for ``Llama2Tokenizer`` (as megalm's preprocessing did), so
  ``AutoTokenizer.from_pretrained`` gives the ids megalm trained on.  Transformers' Llama
  tokenizer assumes Llama's sentencepiece settings; text with characters outside a small
  model's alphabet or repeated spaces may tokenize differently than sentencepiece itself.
* ``HuggingFaceTokenizer``: ``tokenizer.json`` (and ``tokenizer_config.json`` /
  ``special_tokens_map.json`` when present beside it) are copied.
* ``NullTokenizer`` or no tokenizer: nothing is written (reported).

Import (HF directory -> megalm): ``tokenizer.model`` (preferred, as Megatron does for
Llama) or ``tokenizer.json`` is copied into ``<save>/tokenizer/`` and recorded as
``--tokenizer-type/--tokenizer-model`` in the config.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional, Tuple

from megalm.conversion.hf_files import write_json
from megalm.tokenizers.build import SENTENCEPIECE_TYPES

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_tokenizer(
    tokenizer_type: Optional[str],
    save_dir: str,
    max_length: int,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> Tuple[dict, str]:
    """Write the tokenizer files; returns (special token ids for config.json, a one-line report)."""
    if tokenizer_type in (None, "NullTokenizer"):
        return {}, f"tokenizer: {tokenizer_type or 'none'} in the checkpoint's config: no tokenizer files written"
    if tokenizer_type == "GPT2BPETokenizer":
        files = (("--vocab-file", vocab_file), ("--merge-file", merge_file))
    else:
        files = (("--tokenizer-model", tokenizer_model),)
    for flag, path in files:
        if not path or not os.path.exists(path):
            return {}, (
                f"tokenizer: {path!r} (from the checkpoint's config) not found: no tokenizer files "
                f"written; pass {flag} PATH"
            )
    if tokenizer_type == "GPT2BPETokenizer":
        return _export_gpt2_bpe(vocab_file, merge_file, save_dir, max_length)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return _export_sentencepiece(tokenizer_model, save_dir, max_length, add_bos=tokenizer_type == "Llama2Tokenizer")
    if tokenizer_type == "HuggingFaceTokenizer":
        return _export_hf_tokenizer(tokenizer_model, save_dir)
    return {}, f"tokenizer: unknown type {tokenizer_type!r}: no tokenizer files written"


def _export_sentencepiece(model_file: str, save_dir: str, max_length: int, add_bos: bool) -> Tuple[dict, str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    shutil.copyfile(model_file, os.path.join(save_dir, "tokenizer.model"))
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    ids = {k: (v if v >= 0 else None) for k, v in ids.items()}
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    for key, token_id in (
        ("bos_token", ids["bos_token_id"]),
        ("eos_token", ids["eos_token_id"]),
        ("pad_token", ids["pad_token_id"]),
        ("unk_token", sp.unk_id() if sp.unk_id() >= 0 else None),
    ):
        if token_id is not None:
            config[key] = sp.id_to_piece(token_id)
    write_json(os.path.join(save_dir, "tokenizer_config.json"), config)
    return ids, (
        f"tokenizer: copied sentencepiece {model_file} as tokenizer.model (LlamaTokenizer, "
        f"{'BOS added' if add_bos else 'no BOS added'})"
    )


def _export_gpt2_bpe(vocab_file: str, merge_file: str, save_dir: str, max_length: int) -> Tuple[dict, str]:
    """vocab.json + merges.txt (GPT2Tokenizer's files) and the same tokenizer as tokenizer.json."""
    from megalm.tokenizers.gpt2_bpe_tokenizer import EOD_TOKEN, GPT2BPETokenizer

    tok = GPT2BPETokenizer(vocab_file, merge_file)
    shutil.copyfile(vocab_file, os.path.join(save_dir, "vocab.json"))
    shutil.copyfile(merge_file, os.path.join(save_dir, "merges.txt"))
    tok.save_tokenizer_json(os.path.join(save_dir, "tokenizer.json"))
    write_json(
        os.path.join(save_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": EOD_TOKEN,
            "eos_token": EOD_TOKEN,
            "unk_token": EOD_TOKEN,
            "add_prefix_space": False,
            "add_bos_token": False,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
        },
    )
    ids = {"bos_token_id": tok.eod, "eos_token_id": tok.eod, "pad_token_id": None}
    return ids, f"tokenizer: GPT-2 BPE {vocab_file} + {merge_file} written as vocab.json, merges.txt, tokenizer.json"


def _export_hf_tokenizer(path: str, save_dir: str) -> Tuple[dict, str]:
    from megalm.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer

    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    json_file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(json_file):
        return {}, f"tokenizer: {path} has no tokenizer.json: no tokenizer files written"
    shutil.copyfile(json_file, os.path.join(save_dir, "tokenizer.json"))
    copied = ["tokenizer.json"]
    for name in HF_TOKENIZER_FILES[1:]:
        if os.path.isfile(os.path.join(directory, name)):
            shutil.copyfile(os.path.join(directory, name), os.path.join(save_dir, name))
            copied.append(name)
    tok = HuggingFaceTokenizer(path)
    if "tokenizer_config.json" not in copied:
        from tokenizers import Tokenizer

        eos = Tokenizer.from_file(json_file).id_to_token(tok.eod)
        write_json(
            os.path.join(save_dir, "tokenizer_config.json"),
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos},
        )
        copied.append("tokenizer_config.json (written)")
    ids = {"eos_token_id": tok.eod, "pad_token_id": tok.pad if tok.pad >= 0 else None}
    return ids, f"tokenizer: copied {', '.join(copied)} from {directory}"


def import_tokenizer(hf_dir: str, save_root: str) -> Tuple[Optional[str], Optional[str], str]:
    """Copy the HF directory's tokenizer; returns (tokenizer type, model path, a one-line report)."""
    target = os.path.join(save_root, "tokenizer")
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
        os.makedirs(target, exist_ok=True)
        shutil.copyfile(os.path.join(hf_dir, "tokenizer.model"), os.path.join(target, "tokenizer.model"))
        path = os.path.abspath(os.path.join(target, "tokenizer.model"))
        return "SentencePieceTokenizer", path, f"tokenizer: sentencepiece tokenizer.model copied to {path}"
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        os.makedirs(target, exist_ok=True)
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf_dir, name)):
                shutil.copyfile(os.path.join(hf_dir, name), os.path.join(target, name))
        path = os.path.abspath(target)
        return "HuggingFaceTokenizer", path, f"tokenizer: tokenizer.json copied to {path}"
    return None, None, f"tokenizer: none in {hf_dir} (give --tokenizer-type/--tokenizer-model when training)"

"""``DataConfig``: where samples come from, how they are split and tokenized, and the ``--split``
parser (the data package's too: it checks the files, this section the flag).  The flags each
``--tokenizer-type`` needs are the tokenizers' table (a lower layer)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

from megalm.config.fields import ConfigError, Section, check
from megalm.config.fields import flag_field as _f
from megalm.tokenizers.build import TOKENIZER_TYPES, missing_tokenizer_flags  # noqa: F401 (cross.py)


def split_fractions(split: str, error=ConfigError) -> List[float]:
    """``"969,30,1"`` -> normalized ``[train, valid, test]`` fractions (missing ones are 0); a bad
    string raises ``error``.  Parsed as Megatron's parser does: the numbers in the string, so the
    literal quotes of Megatron's example scripts (``--split "'99,1,0'"``) work, and ``/`` separates
    as well as ``,``."""
    parts = [x for x in re.split(r"[,/]", (split or "").strip("'\" ")) if x.strip()]
    try:
        values = [float(x) for x in parts]
    except ValueError:
        raise error(f"--split {split!r} must be comma-separated numbers, e.g. 969,30,1") from None
    if not values or len(values) > 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise error(f"--split {split!r} needs up to three non-negative proportions with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


@dataclass
class DataConfig(Section):
    """Where samples come from and how they are split and tokenized."""

    data_path: Optional[List[str]] = _f(None, "Blend: 'w1 prefix1 w2 prefix2 ...' or a single prefix.", nargs="*")
    split: str = _f("969,30,1", "Train,valid,test proportions of --data-path.")
    train_data_path: Optional[List[str]] = _f(None, "Separate training blend.", nargs="*")
    valid_data_path: Optional[List[str]] = _f(None, "Separate validation blend.", nargs="*")
    test_data_path: Optional[List[str]] = _f(None, "Separate test blend.", nargs="*")
    data_cache_path: Optional[str] = _f(None, "Where built sample indices are cached (default: beside the data).")
    mid_level_dataset_surplus: float = _f(
        0.005, "Extra fraction of samples each blended dataset builds beyond its share, as in Megatron."
    )
    mock_data: bool = _f(False, "Use deterministic synthetic data.")
    tokenizer_type: Optional[str] = _f(None, "Tokenizer.", choices=list(TOKENIZER_TYPES))
    tokenizer_model: Optional[str] = _f(None, "Sentencepiece model file or Hugging Face tokenizer.json / directory.")
    vocab_file: Optional[str] = _f(None, "GPT2BPETokenizer: the vocab.json (e.g. gpt2-vocab.json).")
    merge_file: Optional[str] = _f(None, "GPT2BPETokenizer: the BPE merges (e.g. gpt2-merges.txt).")
    num_workers: int = _f(2, "DataLoader worker processes.")
    dataloader_type: str = _f(
        "single",
        "Sample order: single (in order, from the consumed samples on) or cyclic "
        "(epochs of shuffled samples seeded by --seed and the epoch, re-iterated "
        "endlessly; for train, valid and test as in Megatron).",
        choices=["single", "cyclic"],
    )
    data_sharding: bool = _f(
        True,
        "With --dataloader-type cyclic: shuffle over all samples instead of each "
        "data-parallel rank within its own contiguous bucket.",
        flag="--no-data-sharding",
        action="store_false",
    )
    eod_mask_loss: bool = _f(False, "Mask the loss on end-of-document tokens.")
    reset_position_ids: bool = _f(False, "Restart the position ids at 0 after each end-of-document token.")
    reset_attention_mask: bool = _f(
        False,
        "Document-masked causal attention: a token attends only to earlier tokens of its own document "
        "(documents end at the tokenizer's end-of-document token), as Megatron's get_ltor_masks_and_position_ids.",
    )
    qkv_format: str = _f(
        "sbhd",
        "With --reset-attention-mask: 'sbhd' builds the dense [b, 1, s, s] document mask; 'thd' packs the "
        "micro-batch's documents as cumulative sequence lengths (Megatron-core's PackedSeqParams, qkv_format "
        "'thd'): attention runs per document without a mask (flash-attn's varlen kernel where it runs) and "
        "RoPE positions restart in every document.",
        choices=["sbhd", "thd"],
    )

    def validate(self) -> None:
        """Data sources and split (the tokenizer flags and the document mask: cross-section)."""
        sources = [self.data_path, self.train_data_path, self.valid_data_path, self.test_data_path]
        check(not (self.mock_data and any(sources)), "--mock-data cannot be combined with data paths")
        check(
            not (self.data_path and any(sources[1:])),
            "give either --data-path or --train/valid/test-data-path, not both",
        )
        if self.split:
            split_fractions(self.split)
        check(self.mid_level_dataset_surplus >= 0, "--mid-level-dataset-surplus must be >= 0")

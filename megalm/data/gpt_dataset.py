"""GPT pretraining samples: fixed-length windows over shuffled, concatenated documents.

Built as Megatron-LM's ``GPTDataset``.  For ``num_samples`` samples of ``seq_length``
tokens over the split's documents (``T`` tokens per epoch):

* epochs ``E = ceil((num_samples * seq_length + 1) / T)``;
* document index: the documents repeated ``E`` times and shuffled (seeded); when the last
  epoch would contribute fewer than 80% of an epoch's samples it is shuffled separately,
  so the partial epoch still draws from every document;
* sample index: where each sample starts, as (position in the document index, offset);
  samples are ``seq_length + 1`` tokens and consecutive ones share one token;
* shuffle index: a seeded permutation of the samples (the separated last epoch's samples
  are permuted among themselves, after the others).

The three indices are built once and cached (see :mod:`index_cache`).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

from megalm.data import helpers
from megalm.data.index_cache import PicklesMappedArrays, default_cache_dir, load_or_build
from megalm.data.indexed_dataset import DataError
from megalm.log import get_logger

logger = get_logger(__name__)

LAST_EPOCH_THRESHOLD = 0.80  # Megatron's: separate the final epoch below 80% of an epoch
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@dataclass(frozen=True)
class GPTDatasetConfig:
    seq_length: int
    seed: int
    eod: int
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False  # items carry "document_ids"
    cache_dir: Optional[str] = None  # None: "cache/GPTDataset_indices" beside the data


def _md5(array: np.ndarray) -> str:
    return hashlib.md5(np.ascontiguousarray(array).tobytes()).hexdigest()


def plan_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int):
    """``(num_epochs, separate_final_epoch, samples_before_final_epoch)`` as Megatron computes them."""
    if num_samples is None:  # one epoch, as Megatron's GPTDataset without a sample count
        return 1, False, None
    needed = num_samples * seq_length + 1
    num_epochs = max(1, math.ceil(needed / tokens_per_epoch))
    if num_epochs == 1:
        return 1, False, None
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - 1) // seq_length
    separate = from_final < int(LAST_EPOCH_THRESHOLD * per_epoch)
    return num_epochs, separate, before_final


def build_gpt_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int, seed: int
) -> Dict[str, np.ndarray]:
    """Document, sample and shuffle indices for ``num_samples`` samples (see module docstring)."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 1:
        raise DataError(f"the {len(documents)} documents of this split hold no tokens")
    num_epochs, separate, before_final = plan_epochs(tokens_per_epoch, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    document_index = helpers.build_document_index(documents, num_epochs, rng, separate)
    sample_index = helpers.build_sample_index(sequence_lengths, document_index, seq_length)
    total = sample_index.shape[0] - 1
    shuffle_index = helpers.build_shuffle_index(before_final if separate else total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def positions_restarting_after(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Position ids that restart at 0 after every end-of-document token (``--reset-position-ids``, as
    Megatron's ``get_ltor_masks_and_position_ids``): ``j - (index of the last eod before j) - 1``."""
    index = torch.arange(tokens.numel(), dtype=torch.int64)
    starts = torch.zeros_like(index)
    starts[1:] = torch.where(tokens[:-1] == eod, index[1:], 0)
    return index - torch.cummax(starts, dim=0).values


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Which document each position belongs to (``--reset-attention-mask``): the number of
    end-of-document tokens strictly before it, so an eod closes its own document (as Megatron's
    ``get_ltor_masks_and_position_ids``: after an eod at ``i``, positions ``> i`` stop seeing ``<= i``)."""
    ids = torch.zeros(tokens.numel(), dtype=torch.int64)
    ids[1:] = torch.cumsum(tokens[:-1] == eod, dim=0)
    return ids


class GPTDataset(PicklesMappedArrays, torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens from ``documents`` of a low-level dataset.

    ``indexed_dataset`` is an :class:`IndexedDataset` (or the mock); ``documents`` the
    sequence ids of this split; ``len(self) >= num_samples``.  Item ``i`` is a dict of
    ``tokens``, ``labels`` (tokens shifted by one), ``loss_mask`` (float32, 0 where the
    input token is end-of-document with ``eod_mask_loss``) and ``position_ids``; with
    ``reset_attention_mask`` also ``document_ids`` (:func:`document_ids`).
    """

    def __init__(
        self, indexed_dataset, documents: np.ndarray, num_samples: Optional[int], split: str, config: GPTDatasetConfig
    ):
        if num_samples is not None and num_samples < 1:
            raise DataError(f"GPTDataset ({split}) needs num_samples >= 1 (or None: one epoch), got {num_samples}")
        if config.seq_length < 1:
            raise DataError(f"--seq-length must be >= 1, got {config.seq_length}")
        self.dataset = indexed_dataset
        self.documents = np.asarray(documents, dtype=np.int32)
        if self.documents.size == 0:
            raise DataError(f"GPTDataset ({split}) of {self.path_prefix or 'mock data'} has no documents")
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.description = self._describe()
        cache_dir = None
        if self.path_prefix is not None:
            cache_dir = config.cache_dir or default_cache_dir(self.path_prefix)
        t0 = time.perf_counter()
        arrays, self.built_indices = load_or_build(
            cache_dir,
            f"GPTDataset-{split}",
            self.description,
            INDEX_NAMES,
            lambda: build_gpt_indices(
                self.dataset.sequence_lengths, self.documents, num_samples, config.seq_length, config.seed
            ),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        logger.info(
            "GPTDataset %s: %d samples, indices %s in %.2f s",
            split,
            len(self),
            "built" if self.built_indices else "loaded",
            time.perf_counter() - t0,
        )

    @property
    def path_prefix(self) -> Optional[str]:
        return getattr(self.dataset, "path_prefix", None)

    def _describe(self) -> dict:
        """Everything the indices depend on (hashed to name the cache files)."""
        lengths = np.asarray(self.dataset.sequence_lengths)[self.documents]
        return {
            "class": "GPTDataset",
            "index_algorithm": 1,
            "dataset": os.path.abspath(self.path_prefix) if self.path_prefix else repr(self.dataset),
            "split": self.split,
            "num_samples": None if self.num_samples is None else int(self.num_samples),
            "seq_length": int(self.config.seq_length),
            "seed": int(self.config.seed),
            "add_extra_token": 1,
            "num_documents": int(self.documents.size),
            "documents_md5": _md5(self.documents),
            "sequence_lengths_md5": _md5(lengths.astype(np.int32)),
        }

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens_of(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``idx`` (after shuffling)."""
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(x) for x in self.sample_index[i])
        doc_end, off_end = (int(x) for x in self.sample_index[i + 1])
        if doc_beg == doc_end:
            return np.asarray(
                self.dataset.get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1), dtype=np.int64
            )
        parts = [self.dataset.get(int(self.document_index[doc_beg]), off_beg)]
        parts += [self.dataset.get(int(self.document_index[j])) for j in range(doc_beg + 1, doc_end)]
        parts.append(self.dataset.get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        text = torch.from_numpy(self.tokens_of(idx))
        tokens = text[:-1].contiguous()
        labels = text[1:].contiguous()
        loss_mask = torch.ones(self.config.seq_length, dtype=torch.float32)
        if self.config.eod_mask_loss:
            loss_mask[tokens == self.config.eod] = 0.0
        position_ids = torch.arange(self.config.seq_length, dtype=torch.int64)
        if self.config.reset_position_ids:
            position_ids = positions_restarting_after(tokens, self.config.eod)
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.config.reset_attention_mask:
            item["document_ids"] = document_ids(tokens, self.config.eod)
        return item

"""From the data flags to train / valid / test datasets (Megatron's dataset builder).

* ``--data-path "0.3 A 0.7 B"`` (or one prefix without weight) is split by documents with
  ``--split 969,30,1``; each prefix is split the same way and the splits are blended.
* ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` give each split its
  own blend of whole datasets.
* ``--mock-data`` uses :class:`MockIndexedDataset`, split as a single prefix.

Every prefix used is checked first (:func:`validate_data`): its ``.idx`` and ``.bin`` exist
and agree, and its token ids are below the tokenizer's vocabulary size (scanned once per
prefix and cached, see :mod:`megalm.data.token_ids`).  Bad data raises a
:class:`~megalm.data.indexed_dataset.DataError` naming the file or prefix.

Sample counts per split follow Megatron (:func:`get_train_valid_test_num_samples`); a blend
of ``n`` samples asks each prefix for ``ceil(ceil(n * weight) * (1 + surplus))`` samples
(``--mid-level-dataset-surplus``, 0.005) and is ``sum(ceil(n * weight))`` long, exactly as
megatron-core's builder (:func:`blend_sample_counts`), so a blend's sample order is Megatron's.
When ``torch.distributed`` is initialized, global rank 0 checks and builds (and
caches) every index first, then after a barrier the other ranks load them: one barrier on
the default group, no other communication.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch.distributed as dist

from megalm.data.blended_dataset import BlendedDataset, normalize_weights
from megalm.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megalm.data.indexed_dataset import DataError, IndexedDataset
from megalm.data.mock_dataset import MockIndexedDataset
from megalm.data.split import parse_split, split_document_ranges  # noqa: F401 (parse_split: re-exported)
from megalm.data.token_ids import check_token_ids

SPLITS = ("train", "valid", "test")


# --- parsing ---------------------------------------------------------------------------


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(paths: Optional[Sequence[str]]) -> Tuple[List[str], Optional[List[float]]]:
    """``(prefixes, weights)`` from ``["0.3", "A", "0.7", "B"]``, or ``["A", "B", ...]`` (weights None:
    an unweighted blend, Megatron's rule: an odd count, or pairs whose first items are not numbers).

    Elements may themselves hold several whitespace-separated items (a quoted blend).
    """
    items = [tok for p in (paths or []) for tok in str(p).split()]
    if not items:
        raise DataError("empty data path")
    if len(items) % 2:
        if _number(items[0]) is not None:
            raise DataError(f"data path {' '.join(items)!r}: expected 'weight prefix' pairs (or prefixes only)")
        return items, None
    weights = [_number(w) for w in items[0::2]]
    if all(w is None for w in weights):
        return items, None
    if any(w is None for w in weights):
        bad = next(w for w, x in zip(items[0::2], weights) if x is None)
        raise DataError(f"data path {' '.join(items)!r}: {bad!r} is not a weight; expected 'weight prefix' pairs")
    if any(w <= 0 for w in weights):
        raise DataError(f"data path {' '.join(items)!r}: weights must be positive (drop zero-weight prefixes)")
    return list(items[1::2]), [float(x) for x in normalize_weights(weights)]


def get_train_valid_test_num_samples(cfg, train_iters: Optional[int] = None) -> Tuple[int, int, int]:
    """Samples each split must provide, as Megatron computes them.

    train = train_iters x global batch (or --train-samples); valid =
    (train_iters // eval_interval + 1) x eval_iters x global batch; test = eval_iters x
    global batch.  ``train_iters``: with --train-samples, the iterations the run will make (the
    trainer counts them through a batch ramp-up; default --train-samples // global batch).
    """
    t = cfg.training
    gbs = t.global_batch_size or t.micro_batch_size * (cfg.parallel.data_parallel_size or 1)
    if t.train_samples is not None:
        train_samples = t.train_samples
        if t.train_iters is not None:
            train_iters = t.train_iters
        elif train_iters is None:
            train_iters = t.train_samples // gbs
    elif t.train_iters is not None:
        train_iters = t.train_iters
        train_samples = train_iters * gbs
    else:
        raise DataError("the data pipeline needs --train-iters or --train-samples to size the datasets")
    eval_iters = t.eval_iters if t.eval_iters else 0
    valid = (train_iters // t.eval_interval + 1) * eval_iters * gbs
    test = eval_iters * gbs
    return train_samples, valid, test


# --- building --------------------------------------------------------------------------


def _gpt_config(cfg, eod: int) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        seq_length=cfg.model.seq_length,
        seed=cfg.training.seed,
        eod=eod,
        eod_mask_loss=cfg.data.eod_mask_loss,
        reset_position_ids=cfg.data.reset_position_ids,
        reset_attention_mask=cfg.data.reset_attention_mask,
        cache_dir=cfg.data.data_cache_path,
    )


def _split_datasets(low_level, split: Sequence[float], num_samples: Sequence[int], config) -> list:
    """One GPTDataset per split of one low-level dataset (None where empty or not needed; a count of
    None: one epoch)."""
    out = []
    for name, (beg, end), n in zip(SPLITS, split_document_ranges(len(low_level), split), num_samples):
        if (n is not None and n <= 0) or end <= beg:
            out.append(None)
        else:
            out.append(GPTDataset(low_level, np.arange(beg, end, dtype=np.int32), n, name, config))
    return out


def blend_sample_counts(weights: Sequence[float], n: int, surplus: float) -> Tuple[List[int], int]:
    """``(samples asked of each dataset, length of the blend)`` for a blend of ``n`` samples.

    As megatron-core's ``_get_size_per_split_per_dataset`` and BlendedDataset size: with the
    normalized weights ``w``, the target of dataset ``d`` is ``t_d = ceil(n * w_d)``; it is asked
    for ``ceil(t_d * (1 + surplus))`` samples and the blend is ``sum(t_d)`` long (>= n).
    """
    targets = [int(math.ceil(n * w)) for w in normalize_weights(weights).tolist()]
    return [int(math.ceil(t * (1 + surplus))) for t in targets], sum(targets)


def _unweighted_blend(prefixes, split, num_samples, config, cache_dir) -> list:
    """Megatron's blend without weights: one epoch of every prefix's split, blended in proportion
    to their sizes, ``min(n, total)`` samples; a split that needs more than one epoch of all of
    them is refused (give weights to repeat data)."""
    per_prefix = [
        _split_datasets(IndexedDataset(p), split, [None if n > 0 else 0 for n in num_samples], config) for p in prefixes
    ]
    out = []
    for s, n in enumerate(num_samples):
        parts = [p[s] for p in per_prefix]
        if n <= 0 or all(p is None for p in parts):
            out.append(None)
            continue
        parts = [p for p in parts if p is not None]
        total = sum(len(p) for p in parts)
        if total < n:
            raise DataError(
                f"{SPLITS[s]} split needs {n} samples but one epoch of {len(prefixes)} unweighted data paths holds "
                f"{total}; give weights (--data-path 'w1 A w2 B') to repeat data"
            )
        out.append(BlendedDataset(parts, [len(p) for p in parts], n, cache_dir))
    return out


def _blend(prefixes, weights, split, num_samples, config, cache_dir, surplus) -> list:
    """Per split: the single dataset, or a BlendedDataset of every prefix's split."""
    if weights is None and len(prefixes) > 1:
        return _unweighted_blend(prefixes, split, num_samples, config, cache_dir)
    if weights is None:
        return _split_datasets(IndexedDataset(prefixes[0]), split, num_samples, config)
    counts = [blend_sample_counts(weights, n, surplus) for n in num_samples]
    per_prefix = []
    for d, prefix in enumerate(prefixes):
        sizes = [requests[d] for requests, _ in counts]
        per_prefix.append(_split_datasets(IndexedDataset(prefix), split, sizes, config))
    out = []
    for s, n in enumerate(num_samples):
        parts = [p[s] for p in per_prefix]
        if n <= 0 or all(p is None for p in parts):
            out.append(None)
            continue
        if any(p is None for p in parts):
            empty = [prefixes[i] for i, p in enumerate(parts) if p is None]
            raise DataError(f"{SPLITS[s]} split of {empty} is empty; cannot blend it (check --split)")
        out.append(BlendedDataset(parts, weights, counts[s][1], cache_dir))
    return out


def _used_prefixes(cfg, num_samples: Sequence[int]) -> List[str]:
    """Every prefix the datasets will read, in flag order (none for --mock-data)."""
    d = cfg.data
    if d.mock_data:
        return []
    if d.data_path:
        return parse_blend(d.data_path)[0]
    per_split = (d.train_data_path, d.valid_data_path, d.test_data_path)
    if not any(per_split):
        raise DataError("no data: give --data-path, --train/valid/test-data-path or --mock-data")
    return [p for paths, n in zip(per_split, num_samples) if paths and n > 0 for p in parse_blend(paths)[0]]


def _tokenizer_label(cfg, tokenizer) -> str:
    """The tokenizer as the flags name it, for error messages."""
    d = cfg.data
    source = d.tokenizer_model or d.vocab_file
    name = d.tokenizer_type or type(tokenizer).__name__
    return f"{name} {source}" if source else name


def _check_data(cfg, tokenizer, num_samples: Sequence[int]) -> None:
    """Open every used prefix (its files exist and agree) and check its token ids (cached scan)."""
    if tokenizer is None:
        raise DataError(
            "the data pipeline needs a tokenizer for its end-of-document id "
            "(for --mock-data e.g. --tokenizer-type NullTokenizer --vocab-size N)"
        )
    label = _tokenizer_label(cfg, tokenizer)
    for prefix in dict.fromkeys(_used_prefixes(cfg, num_samples)):
        check_token_ids(IndexedDataset(prefix), tokenizer.vocab_size, label, cfg.data.data_cache_path)


def validate_data(cfg, tokenizer, num_samples: Optional[Sequence[int]] = None) -> None:
    """Raise a :class:`DataError` naming the problem if any data prefix is missing, damaged or
    holds token ids >= the tokenizer's vocabulary size.

    Collective when a process group exists (rank 0 first, one barrier; the other ranks read
    its cached scan): every rank raises the same error.  Cheap to repeat once cached.  Call
    it before creating outputs (metrics file, checkpoints) so bad data leaves none behind.
    """
    if num_samples is None:
        num_samples = get_train_valid_test_num_samples(cfg)
    run_rank_zero_first(lambda: _check_data(cfg, tokenizer, num_samples))


def _build_datasets(cfg, tokenizer, num_samples: Sequence[int]) -> list:
    d = cfg.data
    config = _gpt_config(cfg, tokenizer.eod)
    if d.mock_data:
        mock = MockIndexedDataset(
            tokenizer.vocab_size, tokenizer.eod, max_length=2 * cfg.model.seq_length, seed=cfg.training.seed
        )
        return _split_datasets(mock, parse_split(d.split), num_samples, config)
    if d.data_path:
        prefixes, weights = parse_blend(d.data_path)
        return _blend(
            prefixes, weights, parse_split(d.split), num_samples, config, d.data_cache_path, d.mid_level_dataset_surplus
        )
    out = []
    for s, paths in enumerate((d.train_data_path, d.valid_data_path, d.test_data_path)):
        if not paths or num_samples[s] <= 0:
            out.append(None)
            continue
        prefixes, weights = parse_blend(paths)
        only = [num_samples[s] if i == s else 0 for i in range(3)]
        whole = [1.0 if i == s else 0.0 for i in range(3)]
        out.append(_blend(prefixes, weights, whole, only, config, d.data_cache_path, d.mid_level_dataset_surplus)[s])
    return out


def _check_and_build(cfg, tokenizer, num_samples: Sequence[int], is_built_on_rank: bool):
    """On every rank: check the data (so every rank fails alike); build where data is read."""
    _check_data(cfg, tokenizer, num_samples)
    return _build_datasets(cfg, tokenizer, num_samples) if is_built_on_rank else None


def run_rank_zero_first(build: Callable[[], object]) -> object:
    """``build()`` on global rank 0, a barrier, then on the other ranks (they load its cache).

    Without an initialized process group this is just ``build()``.  An error on rank 0 is
    raised only after the barrier, so the other ranks are not left waiting.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return build()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = build()
        except Exception as e:  # noqa: BLE001 - re-raised after the barrier
            error = e
    dist.barrier()
    if error is not None:
        raise error
    if dist.get_rank() != 0:
        result = build()
    return result


def build_train_valid_test_datasets(
    cfg, tokenizer, is_built_on_rank: bool = True, num_samples: Optional[Sequence[int]] = None
):
    """``(train, valid, test)`` datasets (None where a split is empty or unneeded).

    Collective when a process group exists: every rank must call it and checks the data
    (:func:`validate_data`), so bad data raises the same :class:`DataError` on every rank;
    only ranks with ``is_built_on_rank`` construct datasets (the others get ``(None, None, None)``).
    """
    if num_samples is None:
        num_samples = get_train_valid_test_num_samples(cfg)
    result = run_rank_zero_first(lambda: _check_and_build(cfg, tokenizer, num_samples, is_built_on_rank))
    return tuple(result) if result is not None else (None, None, None)

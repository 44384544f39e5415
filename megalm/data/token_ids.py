"""Token ids of a corpus against the tokenizer's vocabulary: checked once per prefix, cached.

An id at or beyond the vocabulary size fails differently by layout (an ``IndexError`` in
the embedding without tensor parallelism, silently-zero embeddings with it), so datasets are
checked when they are built.  Scanning a ``.bin`` is O(tokens), so the result (the layout of
the ``.idx`` checked against the ``.bin``, then the smallest and largest id) is cached in
the index cache beside the GPT indices (:mod:`megalm.data.index_cache`), keyed by the
prefix and the size and modification time of both files: rewriting either one rescans.

No communication: each process reads the cache or scans; the builder runs rank 0 first
(:func:`megalm.data.builder.run_rank_zero_first`) so the other ranks only read the cache.
"""

from __future__ import annotations

import os

import numpy as np

from megalm.data.index_cache import default_cache_dir, load_or_build
from megalm.data.indexed_dataset import DataError, IndexedDataset, data_file_path, index_file_path

CACHE_STEM = "TokenIdRange"
SCAN_ALGORITHM = 1  # bump when check_layout/token_id_range change what they accept


class TokenIdError(DataError):
    """A corpus holds token ids outside ``[0, vocabulary size)``."""


def _file_signature(path: str) -> dict:
    st = os.stat(path)
    return {"bytes": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def describe(dataset: IndexedDataset) -> dict:
    """What the scan's result depends on: the prefix and both files' size and mtime."""
    prefix = dataset.path_prefix
    return {
        "class": CACHE_STEM,
        "algorithm": SCAN_ALGORITHM,
        "dataset": os.path.abspath(prefix),
        "bin": _file_signature(data_file_path(prefix)),
        "idx": _file_signature(index_file_path(prefix)),
    }


def _scan(dataset: IndexedDataset) -> dict:
    dataset.check_layout()
    found = dataset.token_id_range()
    return {"token_id_range": np.asarray(found if found is not None else [], dtype=np.int64)}


def token_id_range(dataset: IndexedDataset, cache_dir: str | None = None) -> tuple[tuple[int, int] | None, bool]:
    """``((smallest, largest) or None when empty, scanned)``, from the cache when it is current.

    ``cache_dir`` None: the default index cache beside the data.  ``scanned`` is False when
    the answer came from the cache.  Raises :class:`IndexedDatasetError` on a garbled .idx.
    """
    cache_dir = cache_dir or default_cache_dir(dataset.path_prefix)
    arrays, scanned = load_or_build(
        cache_dir, CACHE_STEM, describe(dataset), ("token_id_range",), lambda: _scan(dataset)
    )
    values = [int(x) for x in np.asarray(arrays["token_id_range"])]
    return (tuple(values) if values else None), scanned


def check_token_ids(dataset: IndexedDataset, vocab_size: int, tokenizer: str = "", cache_dir: str | None = None):
    """Raise :class:`TokenIdError` unless every id of ``dataset`` is in ``[0, vocab_size)``.

    ``vocab_size`` is the tokenizer's own (before padding for tensor parallelism);
    ``tokenizer`` describes it for the message (e.g. its type and model file).
    """
    found, _ = token_id_range(dataset, cache_dir)
    if found is None:
        return
    smallest, largest = found
    about = f" (tokenizer {tokenizer})" if tokenizer else ""
    if largest >= vocab_size:
        raise TokenIdError(
            f"data prefix {dataset.path_prefix}: largest token id {largest} >= vocabulary size "
            f"{vocab_size}{about}; was it preprocessed with another tokenizer?"
        )
    if smallest < 0:
        raise TokenIdError(f"data prefix {dataset.path_prefix}: smallest token id {smallest} < 0{about}")

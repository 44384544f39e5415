"""On-disk cache of built dataset indices, keyed by what they depend on.

A dataset describes everything its indices depend on as a JSON-able dict; the md5 of that
description names the files ``<md5>-<stem>-<array>.npy`` in the cache directory, plus a
``<md5>-<stem>-description.json`` written last as the completion marker.  Every file is
written under a temporary name and renamed, so a reader sees whole files or none.  When
the directory is not writable the indices are kept in memory (each rank builds its own;
the result is identical since building is deterministic).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from megalm.log import get_logger

logger = get_logger(__name__)


def default_cache_dir(path_prefix: str, kind: str = "GPTDataset_indices") -> str:
    """``<directory of the data>/cache/<kind>``: where indices go without ``--data-cache-path``."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache", kind)


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _paths(cache_dir: str, stem: str, description: dict, names: Sequence[str]) -> Tuple[str, Dict[str, str]]:
    prefix = os.path.join(cache_dir, f"{description_hash(description)}-{stem}")
    return prefix + "-description.json", {n: f"{prefix}-{n}.npy" for n in names}


def _write_atomic(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load(desc_path: str, array_paths: Dict[str, str], description: dict) -> Optional[Dict[str, np.ndarray]]:
    if not os.path.isfile(desc_path) or not all(map(os.path.isfile, array_paths.values())):
        return None
    with open(desc_path) as f:
        if json.load(f) != json.loads(json.dumps(description)):
            return None
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in array_paths.items()}


def _save(
    cache_dir: str, desc_path: str, array_paths: Dict[str, str], arrays: Dict[str, np.ndarray], description: dict
) -> bool:
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in array_paths.items():
            _write_atomic(path, lambda f, a=arrays[name]: np.save(f, a, allow_pickle=False))
        text = json.dumps(description, sort_keys=True, indent=1).encode()
        _write_atomic(desc_path, lambda f: f.write(text))
        return True
    except OSError as e:
        logger.warning("could not cache indices in %s (%s); keeping them in memory", cache_dir, e)
        return False


def load_or_build(
    cache_dir: Optional[str],
    stem: str,
    description: dict,
    names: Sequence[str],
    build: Callable[[], Dict[str, np.ndarray]],
) -> Tuple[Dict[str, np.ndarray], bool]:
    """Cached arrays for ``description`` if complete, else ``build()`` (saved when possible).

    Returns ``(arrays, built)``; ``built`` is False when the arrays came from the cache.
    """
    if cache_dir is not None:
        desc_path, array_paths = _paths(cache_dir, stem, description, names)
        cached = _load(desc_path, array_paths, description)
        if cached is not None:
            logger.info("loaded %s indices from %s", stem, cache_dir)
            return cached, False
    arrays = build()
    if cache_dir is not None:
        _save(cache_dir, desc_path, array_paths, arrays, description)
    return arrays, True


class PicklesMappedArrays:
    """Mixin: a dataset pickles its memory-mapped index arrays as (file, offset, dtype, shape) and
    maps them again when unpickled, instead of copying their contents into the pickle.

    DataLoader workers are started by ``forkserver`` (:mod:`megalm.data.loaders`), which pickles
    the dataset for every worker: without this, each worker would receive a copy of indices that
    can be gigabytes.  Arrays built in memory (no cache directory) are pickled as they are."""

    def __getstate__(self):
        return {k: _MappedArray.of(v) or v for k, v in self.__dict__.items()}

    def __setstate__(self, state):
        self.__dict__.update({k: v.open() if isinstance(v, _MappedArray) else v for k, v in state.items()})


class _MappedArray:
    """How to map a whole-file ``np.memmap`` (what ``np.load(mmap_mode="r")`` returns) again."""

    def __init__(self, filename: str, offset: int, dtype, shape: tuple, order: str):
        self.filename, self.offset, self.dtype, self.shape, self.order = filename, offset, dtype, shape, order

    @classmethod
    def of(cls, array) -> Optional["_MappedArray"]:
        import mmap

        if not isinstance(array, np.memmap) or not isinstance(array.base, mmap.mmap) or array.filename is None:
            return None  # an in-memory array, or a view into a map: pickled by value
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        return cls(array.filename, array.offset, array.dtype, array.shape, order)

    def open(self) -> np.memmap:
        return np.memmap(
            self.filename, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape, order=self.order
        )

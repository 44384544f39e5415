"""A weighted interleaving of datasets with exact per-dataset sample counts.

Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset
``dataset_index[i]``.  The two arrays come from Megatron-LM's greedy rule
(:func:`helpers.build_blending_indices`): each sample goes to the dataset furthest behind
its share, so after any prefix of ``n`` samples dataset ``d`` has supplied
``weights[d] * n`` samples to within one.  Indices are cached like the GPT indices.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megalm.data import helpers
from megalm.data.index_cache import PicklesMappedArrays, default_cache_dir, description_hash, load_or_build
from megalm.data.indexed_dataset import DataError


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise DataError(f"blend weights (--data-path) must be non-negative with a positive sum, got {list(weights)}")
    return w / w.sum()


class BlendedDataset(PicklesMappedArrays, torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``."""

    def __init__(
        self,
        datasets: List[torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        cache_dir: Optional[str] = None,
    ):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = datasets
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.description = {
            "class": "BlendedDataset",
            "datasets": [description_hash(getattr(d, "description", {"repr": repr(d)})) for d in datasets],
            "weights": [float(w) for w in self.weights],
            "size": self.size,
        }
        if cache_dir is None:
            prefix = getattr(datasets[0], "path_prefix", None)
            if prefix is not None:
                cache_dir = default_cache_dir(prefix, "BlendedDataset_indices")
        arrays, self.built_indices = load_or_build(
            cache_dir, "BlendedDataset", self.description, ("dataset_index", "dataset_sample_index"), self._build
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _build(self) -> Dict[str, np.ndarray]:
        dataset_index, sample_index = helpers.build_blending_indices(self.weights, self.size)
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for d, (count, ds) in enumerate(zip(counts, self.datasets)):
            if count > len(ds):
                raise DataError(f"blend needs {count} samples from dataset {d} but it has only {len(ds)}")
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

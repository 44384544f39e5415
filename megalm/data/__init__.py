"""Data pipeline: Megatron IndexedDatasets, GPT / blended datasets, samplers and loaders.

Modules that need only numpy (indexed_dataset, helpers, text_sources, preprocess) are
imported by the tools without torch; the torch-based entry points below load lazily.
"""

from megalm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype

_LAZY = {
    "GPTDataset": "megalm.data.gpt_dataset",
    "GPTDatasetConfig": "megalm.data.gpt_dataset",
    "MockIndexedDataset": "megalm.data.mock_dataset",
    "BlendedDataset": "megalm.data.blended_dataset",
    "build_train_valid_test_datasets": "megalm.data.builder",
    "get_train_valid_test_num_samples": "megalm.data.builder",
    "MegatronPretrainingSampler": "megalm.data.samplers",
    "MegatronPretrainingRandomSampler": "megalm.data.samplers",
    "build_pretraining_data_loader": "megalm.data.loaders",
    "build_train_valid_test_data_iterators": "megalm.data.loaders",
    "splits_available": "megalm.data.loaders",
    "get_batch_on_this_tp_rank": "megalm.data.batch",
}

__all__ = ["IndexedDataset", "IndexedDatasetBuilder", "optimal_dtype", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megalm.data' has no attribute {name!r}")

"""Blending (exact proportions), blend / split parsing, split boundaries, sample counts, dataset building."""

import math
import os

import numpy as np
import pytest
import torch

from megalm.data import helpers
from megalm.data.blended_dataset import BlendedDataset
from megalm.data.builder import (
    blend_sample_counts,
    build_train_valid_test_datasets,
    get_train_valid_test_num_samples,
    parse_blend,
    parse_split,
    split_document_ranges,
)
from megalm.data.indexed_dataset import DataError, IndexedDatasetBuilder
from megalm.tokenizers import NullTokenizer
from tests.configs import make_config


def greedy_blend(weights, size):
    """Megatron's build_blending_indices as a plain loop (independent reference)."""
    taken = [0] * len(weights)
    index, sample = [], []
    for i in range(size):
        t = max(i, 1)
        errors = [w * t - c for w, c in zip(weights, taken)]
        best = errors.index(max(errors))
        index.append(best)
        sample.append(taken[best])
        taken[best] += 1
    return index, sample


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.2, 0.3, 0.5], [0.1, 0.6, 0.05, 0.25], [1.0]])
def test_blending_indices_match_megatron_greedy(weights):
    index, sample = helpers.build_blending_indices(weights, 2000)
    ref_index, ref_sample = greedy_blend(weights, 2000)
    assert index.tolist() == ref_index and sample.tolist() == ref_sample
    for n in (1, 10, 99, 1000, 2000):  # every prefix is within one sample of its share
        counts = np.bincount(index[:n], minlength=len(weights))
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1)


def test_blend_proportions_exact():
    index, sample = helpers.build_blending_indices([0.3, 0.7], 1000)
    assert np.bincount(index).tolist() == [300, 700]
    index, _ = helpers.build_blending_indices([0.2, 0.3, 0.5], 10_000)
    assert np.bincount(index).tolist() == [2000, 3000, 5000]
    # Each dataset's samples are used in order, each exactly once.
    index, sample = helpers.build_blending_indices([0.2, 0.3, 0.5], 10_000)
    for d, n in enumerate([2000, 3000, 5000]):
        assert sample[index == d].tolist() == list(range(n))


def test_python_fallback_matches_compiled(monkeypatch):
    compiled = helpers.build_blending_indices([0.15, 0.35, 0.5], 3000)
    monkeypatch.setattr(helpers, "_helper_lib", lambda: None)
    fallback = helpers.build_blending_indices([0.15, 0.35, 0.5], 3000)
    assert all(np.array_equal(a, b) for a, b in zip(compiled, fallback))


def test_parse_blend_and_split():
    assert parse_blend(["data/a"]) == (["data/a"], None)
    assert parse_blend(["30", "a", "70", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="'weight prefix' pairs"):
        parse_blend(["0.3", "a", "b"])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)  # Megatron's unweighted blend
    assert parse_blend(["a b c"]) == (["a", "b", "c"], None)
    with pytest.raises(ValueError, match="is not a weight"):
        parse_blend(["0.5", "a", "b", "c"])
    with pytest.raises(ValueError, match="weights must be positive"):
        parse_blend(["0", "a", "1", "b"])
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1/1/2") == pytest.approx([0.25, 0.25, 0.5])
    with pytest.raises(ValueError, match="--split"):
        parse_split("1,2,3,4")


def test_split_boundaries_by_documents():
    assert split_document_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, parse_split("8,1,1")) == [(0, 8), (8, 9), (9, 10)]
    assert split_document_ranges(7, parse_split("1,0,0")) == [(0, 7), (7, 7), (7, 7)]
    assert split_document_ranges(3, parse_split("1,1,1")) == [(0, 1), (1, 2), (2, 3)]


def test_sample_counts_per_split_as_megatron():
    cfg = make_config(train_iters=1000, global_batch_size=32, eval_interval=100, eval_iters=10, validate=False)
    assert get_train_valid_test_num_samples(cfg) == (32_000, (1000 // 100 + 1) * 10 * 32, 320)
    cfg.training.train_iters, cfg.training.train_samples = None, 64_000
    assert get_train_valid_test_num_samples(cfg) == (64_000, (2000 // 100 + 1) * 10 * 32, 320)
    cfg.training.eval_iters = 0
    assert get_train_valid_test_num_samples(cfg) == (64_000, 0, 0)


def write_tagged(prefix, tag, num_docs, vocab=1000):
    """Documents whose tokens all equal ``tag`` except a doc-number token, ending in eod (vocab)."""
    with IndexedDatasetBuilder(str(prefix), np.uint16) as b:
        for d in range(num_docs):
            b.add_item([tag] * 5 + [d % 900 + 10, vocab])
            b.end_document()
        b.finalize()
    return str(prefix)


# The batch and evaluation settings of these tests (not validated: the dataset builders read the config as is).
BATCHES = dict(seq_length=8, train_iters=50, global_batch_size=4, micro_batch_size=2, eval_interval=10, eval_iters=2)


def test_blended_datasets_from_data_path(tmp_path):
    a = write_tagged(tmp_path / "a", 1, 200)
    b = write_tagged(tmp_path / "b", 2, 300)
    cfg = make_config(BATCHES, data_path=["0.25", a, "0.75", b], split="90,5,5", validate=False)
    tok = NullTokenizer(1000)
    train, valid, test = build_train_valid_test_datasets(cfg, tok)
    assert isinstance(train, BlendedDataset) and len(train) == 200 and len(valid) == 48 and len(test) == 8
    assert np.bincount(train.dataset_index).tolist() == [50, 150]
    # Every sample comes from its own dataset: tags 1 (a) and 2 (b) never mix.
    for i in range(len(train)):
        tokens = train[i]["tokens"].numpy()
        own, other = (1, 2) if train.dataset_index[i] == 0 else (2, 1)
        assert own in tokens and other not in tokens
    # Train samples only use each prefix's first 90% of documents.
    gpt_a = train.datasets[0]
    assert gpt_a.documents.min() == 0 and gpt_a.documents.max() == 179
    assert valid.datasets[1].documents.tolist() == list(range(270, 285))
    # Second build loads every index from the cache.
    again = build_train_valid_test_datasets(cfg, tok)
    assert not again[0].built_indices and not again[0].datasets[0].built_indices
    np.testing.assert_array_equal(again[0].dataset_index, train.dataset_index)
    assert torch.equal(again[0][17]["tokens"], train[17]["tokens"])
    assert os.path.isdir(tmp_path / "cache" / "BlendedDataset_indices")


def test_single_prefix_per_split_paths_and_mock(tmp_path):
    a = write_tagged(tmp_path / "a", 1, 100)
    b = write_tagged(tmp_path / "b", 2, 50)
    c = write_tagged(tmp_path / "c", 3, 50)
    tok = NullTokenizer(1000)
    train, valid, test = build_train_valid_test_datasets(
        make_config(BATCHES, data_path=[a], split="98,2,0", validate=False), tok
    )
    assert test is None and len(train) >= 200 and len(valid) >= 48
    assert valid.documents.tolist() == [98, 99]
    train, valid, test = build_train_valid_test_datasets(
        make_config(
            BATCHES,
            train_data_path=[a],
            valid_data_path=["1", b, "1", c],
            test_data_path=[c],
            data_cache_path=str(tmp_path / "cache2"),
            validate=False,
        ),
        tok,
    )
    assert train.documents.tolist() == list(range(100)) and len(train) >= 200
    assert isinstance(valid, BlendedDataset) and np.bincount(valid.dataset_index).tolist() == [24, 24]
    test_tokens = torch.cat([test[i]["tokens"] for i in range(len(test))]).numpy()
    assert 3 in test_tokens and not np.isin(test_tokens, [1, 2]).any()  # only dataset c (tag 3)
    assert len(os.listdir(tmp_path / "cache2")) > 0
    mock_cfg = make_config(BATCHES, mock_data=True, validate=False)
    m1 = build_train_valid_test_datasets(mock_cfg, tok)
    m2 = build_train_valid_test_datasets(mock_cfg, tok)
    assert torch.equal(m1[0][7]["tokens"], m2[0][7]["tokens"]) and m1[0][7]["tokens"].shape == (8,)


def test_errors_name_the_problem(tmp_path):
    tok = NullTokenizer(1000)
    with pytest.raises(ValueError, match="no data"):
        build_train_valid_test_datasets(make_config(BATCHES, validate=False), tok)
    with pytest.raises(ValueError, match="--train-iters or --train-samples"):
        build_train_valid_test_datasets(make_config(BATCHES, train_iters=None, mock_data=True, validate=False), tok)
    from megalm.data.indexed_dataset import IndexedDatasetError

    with pytest.raises(IndexedDatasetError, match="does not exist"):
        build_train_valid_test_datasets(make_config(BATCHES, data_path=[str(tmp_path / "nope")], validate=False), tok)


def megatron_counts(weights, n, surplus=0.005):
    """megatron-core's builder, restated: target ceil(n * w) per dataset, request
    ceil(target * (1 + surplus)), blend length sum(target)."""
    total = sum(weights)
    targets = [math.ceil(n * (w / total)) for w in weights]
    return [math.ceil(t * (1 + surplus)) for t in targets], sum(targets)


def test_blend_sample_counts_are_megatrons():
    # The case: the old ceil(n * w * 1.005) asked one sample fewer of dataset 1, and the blend was n long.
    assert blend_sample_counts([0.3, 0.7], 10383, 0.005) == ([3131, 7306], 10384)
    assert math.ceil(10383 * 0.7 * 1.005) == 7305
    for weights in ([0.3, 0.7], [1, 2, 3], [0.05, 0.95], [5.0]):
        for n in (0, 1, 7, 224, 587, 10383, 123457):
            assert blend_sample_counts(weights, n, 0.005) == megatron_counts(weights, n), (weights, n)
    assert blend_sample_counts([0.3, 0.7], 587, 0.0) == ([177, 411], 588)


def test_blend_built_with_megatrons_sizes(tmp_path):
    """Two synthetic datasets, weights 0.3/0.7, [10383, 587, 224] samples: every GPTDataset is
    asked for Megatron's count and each blend is Megatron's length, its dataset shares greedy."""
    a = write_tagged(tmp_path / "a", 1, 300)
    b = write_tagged(tmp_path / "b", 2, 300)
    cfg = make_config(BATCHES, data_path=["0.3", a, "0.7", b], split="90,6,4", validate=False)
    sizes = [10383, 587, 224]
    datasets = build_train_valid_test_datasets(cfg, NullTokenizer(1000), num_samples=sizes)
    for blend, n in zip(datasets, sizes):
        requests, length = megatron_counts([0.3, 0.7], n)
        assert [part.num_samples for part in blend.datasets] == requests
        assert len(blend) == length
        expected = np.bincount(greedy_blend([0.3, 0.7], length)[0], minlength=2)
        assert np.bincount(blend.dataset_index, minlength=2).tolist() == expected.tolist()
    # A smaller surplus is used when given (and asks for fewer samples).
    cfg.data.mid_level_dataset_surplus = 0.0
    train = build_train_valid_test_datasets(cfg, NullTokenizer(1000), num_samples=sizes)[0]
    assert [part.num_samples for part in train.datasets] == [3115, 7269]


def test_unweighted_data_paths_blend_one_epoch_of_each_by_size(tmp_path):
    """--data-path A B (no weights), as Megatron: one epoch of each prefix's split, blended in
    proportion to their sizes; a split needing more than that is refused."""
    a = write_tagged(tmp_path / "a", 1, 100)
    b = write_tagged(tmp_path / "b", 2, 300)
    cfg = make_config(BATCHES, data_path=[a, b], split="90,10,0", validate=False)
    train, valid, _ = build_train_valid_test_datasets(cfg, NullTokenizer(1000), num_samples=[200, 20, 0])
    parts = train.datasets
    assert [p.num_samples for p in parts] == [None, None] and len(train) == 200
    sizes = [len(p) for p in parts]
    assert sizes[1] > 2.5 * sizes[0] and sum(sizes) >= 200  # one epoch each: 90 and 270 documents of 7 tokens
    counts = np.bincount(train.dataset_index, minlength=2)
    expected = np.bincount(greedy_blend([x / sum(sizes) for x in sizes], 200)[0], minlength=2)
    assert counts.tolist() == expected.tolist()
    assert len(valid) == 20
    with pytest.raises(DataError, match="train split needs 100000 samples but one epoch of 2 unweighted data paths"):
        build_train_valid_test_datasets(cfg, NullTokenizer(1000), num_samples=[100000, 20, 0])

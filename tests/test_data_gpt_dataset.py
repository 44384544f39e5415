"""GPTDataset: Megatron's document / sample / shuffle indices, sample contents, caching, speed."""

import os
import time

import numpy as np
import torch

from megalm.data import helpers
from megalm.data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_indices, plan_epochs
from megalm.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megalm.data.mock_dataset import MockIndexedDataset

EOD = 999


def write_dataset(prefix, num_docs=40, seed=0, max_len=30, vocab=900):
    """Random documents ending in EOD; returns the list of documents."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, vocab, rng.integers(1, max_len)), EOD) for _ in range(num_docs)]
    with IndexedDatasetBuilder(str(prefix), np.uint16) as b:
        for d in docs:
            b.add_item(d)
            b.end_document()
        b.finalize()
    return docs


def megatron_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's build_sample_idx (helpers.cpp, drop_last_partial_sequence=True), as a plain loop."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample, doc_pos, offset = 1, 0, 0
    while sample <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_pos]] - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                if doc_pos == len(doc_idx) - 1:
                    offset = sizes[doc_idx[doc_pos]] - 1
                    break
                doc_pos += 1
                offset = 0
        out[sample] = (doc_pos, offset)
        sample += 1
    return out


def test_sample_index_matches_megatron_loop():
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(200):
        n = int(rng.integers(1, 25))
        sizes = rng.integers(0 if trial % 3 == 0 else 1, 20, size=n).astype(np.int32)  # some empty docs
        if sizes.sum() < 2:
            continue
        seq = int(rng.integers(1, 25))
        epochs = int(rng.integers(1, 4))
        doc_idx = helpers.build_document_index(np.arange(n), epochs, np.random.RandomState(trial), trial % 2 == 0)
        got = helpers.build_sample_index(sizes, doc_idx, seq)
        want = megatron_sample_index(sizes, doc_idx, seq, epochs, int(sizes.sum()))
        np.testing.assert_array_equal(got, want)
        checked += 1
    assert checked > 150


def test_document_index_epochs_and_separate_final_epoch():
    docs = np.arange(10, 20)
    idx = helpers.build_document_index(docs, 3, np.random.RandomState(0), separate_final_epoch=False)
    assert sorted(idx.tolist()) == sorted(docs.tolist() * 3) and idx.dtype == np.int32
    sep = helpers.build_document_index(docs, 3, np.random.RandomState(0), separate_final_epoch=True)
    assert sorted(sep[:20].tolist()) == sorted(docs.tolist() * 2)
    assert sorted(sep[20:].tolist()) == docs.tolist()  # the last epoch alone holds every document once


def test_plan_epochs_like_megatron():
    # 1000 tokens per epoch, seq 10: 99 samples per epoch.
    assert plan_epochs(1000, 99, 10) == (1, False, None)
    # 150 samples need 1501 tokens -> 2 epochs; 99 before the final epoch, 51 from it < 0.8 * 99 -> separate.
    assert plan_epochs(1000, 150, 10) == (2, True, 99)
    # 190 samples: 91 from the final epoch >= 79 -> shuffled together.
    assert plan_epochs(1000, 190, 10) == (2, False, 99)


def test_shuffle_index_keeps_final_epoch_apart():
    idx = helpers.build_shuffle_index(6, 10, np.random.RandomState(1))
    assert sorted(idx[:6].tolist()) == list(range(6)) and sorted(idx[6:].tolist()) == list(range(6, 10))


def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path):
    docs = write_dataset(tmp_path / "ds")
    ds_file = IndexedDataset(str(tmp_path / "ds"))
    seq = 16
    cfg = GPTDatasetConfig(seq_length=seq, seed=7, eod=EOD, eod_mask_loss=True)
    documents = np.arange(5, 35)  # a split: documents 5..34
    ds = GPTDataset(ds_file, documents, 100, "train", cfg)
    tokens_per_epoch = sum(len(docs[i]) for i in documents)
    assert len(ds) >= 100 and len(ds) == (ds.document_index.size // 30 * tokens_per_epoch - 1) // seq
    assert set(ds.document_index.tolist()) == set(documents.tolist())
    stream = np.concatenate([docs[d] for d in ds.document_index])
    seen = set()
    for i in range(len(ds)):
        item = ds[i]
        j = int(ds.shuffle_index[i])
        seen.add(j)
        window = torch.from_numpy(stream[j * seq : j * seq + seq + 1].astype(np.int64))
        assert torch.equal(item["tokens"], window[:-1]) and torch.equal(item["labels"], window[1:])
        assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32
        assert torch.equal(item["position_ids"], torch.arange(seq))
        assert torch.equal(item["loss_mask"], (window[:-1] != EOD).float())
    assert seen == set(range(len(ds)))
    no_mask = GPTDataset(ds_file, documents, 100, "train", GPTDatasetConfig(seq_length=seq, seed=7, eod=EOD))
    assert torch.equal(no_mask[3]["loss_mask"], torch.ones(seq))


def test_indices_are_cached_and_reused(tmp_path, monkeypatch):
    write_dataset(tmp_path / "ds")
    ds_file = IndexedDataset(str(tmp_path / "ds"))
    calls = []
    real = helpers.build_sample_index
    monkeypatch.setattr(helpers, "build_sample_index", lambda *a: calls.append(1) or real(*a))
    cfg = GPTDatasetConfig(seq_length=8, seed=3, eod=EOD)
    first = GPTDataset(ds_file, np.arange(40), 50, "train", cfg)
    assert first.built_indices and len(calls) == 1
    cache = tmp_path / "cache" / "GPTDataset_indices"
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    second = GPTDataset(IndexedDataset(str(tmp_path / "ds")), np.arange(40), 50, "train", cfg)
    assert not second.built_indices and len(calls) == 1
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    np.testing.assert_array_equal(first.shuffle_index, second.shuffle_index)
    assert torch.equal(first[5]["tokens"], second[5]["tokens"])
    # Anything the indices depend on changes the key: seed, length, samples, split, data.
    GPTDataset(ds_file, np.arange(40), 50, "train", GPTDatasetConfig(seq_length=8, seed=4, eod=EOD))
    GPTDataset(ds_file, np.arange(40), 50, "train", GPTDatasetConfig(seq_length=9, seed=3, eod=EOD))
    GPTDataset(ds_file, np.arange(40), 60, "train", cfg)
    GPTDataset(ds_file, np.arange(30), 50, "train", cfg)
    assert len(calls) == 5
    write_dataset(tmp_path / "ds", seed=1)  # regenerated data at the same path
    again = GPTDataset(IndexedDataset(str(tmp_path / "ds")), np.arange(40), 50, "train", cfg)
    assert again.built_indices and len(calls) == 6


def test_explicit_cache_dir_and_unwritable_cache(tmp_path):
    write_dataset(tmp_path / "ds")
    ds_file = IndexedDataset(str(tmp_path / "ds"))
    ds = GPTDataset(
        ds_file,
        np.arange(40),
        20,
        "valid",
        GPTDatasetConfig(seq_length=8, seed=3, eod=EOD, cache_dir=str(tmp_path / "mycache")),
    )
    assert len(os.listdir(tmp_path / "mycache")) == 4 and ds.built_indices
    (tmp_path / "afile").write_text("x")
    in_memory = GPTDataset(
        ds_file,
        np.arange(40),
        20,
        "valid",
        GPTDatasetConfig(seq_length=8, seed=3, eod=EOD, cache_dir=str(tmp_path / "afile" / "sub")),
    )
    np.testing.assert_array_equal(in_memory.sample_index, ds.sample_index)


def test_mock_dataset_is_deterministic():
    a = MockIndexedDataset(vocab_size=50, eod=49, num_documents=100, max_length=40, seed=3)
    b = MockIndexedDataset(vocab_size=50, eod=49, num_documents=100, max_length=40, seed=3)
    np.testing.assert_array_equal(a.sequence_lengths, b.sequence_lengths)
    for i in range(100):
        doc = a.get(i)
        assert doc[-1] == 49 and (doc[:-1] != 49).all() and doc.max() < 50
        np.testing.assert_array_equal(a.get(i, 1, len(doc) - 1), doc[1:])
    ds = GPTDataset(a, np.arange(100), 30, "train", GPTDatasetConfig(seq_length=12, seed=1, eod=49))
    assert ds.built_indices and ds.path_prefix is None  # mock data is never cached
    assert ds[0]["tokens"].shape == (12,)


def test_index_building_is_vectorized_fast():
    lengths = np.random.default_rng(0).integers(1, 1000, size=400_000, dtype=np.int32)  # ~200 M tokens
    t0 = time.perf_counter()
    idx = build_gpt_indices(lengths, np.arange(lengths.size, dtype=np.int32), 400_000, 1024, seed=1)
    elapsed = time.perf_counter() - t0
    assert idx["sample_index"].shape[0] - 1 >= 400_000
    assert elapsed < 5.0, f"index build took {elapsed:.1f} s"


def test_dataset_messages_reach_megalm_log_on_rank_zero_only(tmp_path, capsys):
    """GPTDataset / the index cache write through megalm's channel: INFO on the logging rank,
    warnings on every rank, each with its rank prefix."""
    from tests.logs import megalm_logs

    write_dataset(tmp_path / "ds")
    ds_file = IndexedDataset(str(tmp_path / "ds"))
    (tmp_path / "afile").write_text("x")
    cfg = GPTDatasetConfig(seq_length=8, seed=3, eod=EOD, cache_dir=str(tmp_path / "afile" / "sub"))
    with megalm_logs("stdout", rank=0, world_size=2):
        ds = GPTDataset(ds_file, np.arange(40), 20, "valid", cfg)
    out = capsys.readouterr().out
    assert f"[megalm rank 0] GPTDataset valid: {len(ds)} samples, indices built in" in out
    assert f"[megalm rank 0] WARNING: could not cache indices in {tmp_path / 'afile' / 'sub'}" in out
    with megalm_logs("stdout", rank=1, world_size=2):
        GPTDataset(ds_file, np.arange(40), 20, "valid", cfg)
    out = capsys.readouterr().out
    assert "GPTDataset valid" not in out and "[megalm rank 1] WARNING: could not cache indices" in out


def test_reset_position_ids_restart_after_each_eod():
    """--reset-position-ids against Megatron's loop in get_ltor_masks_and_position_ids."""
    from megalm.data.gpt_dataset import positions_restarting_after

    def megatron_loop(tokens, eod):
        position_ids = torch.arange(tokens.numel())
        prev = 0
        for i in (position_ids[tokens == eod]).tolist():
            position_ids[i + 1 :] -= i + 1 - prev
            prev = i + 1
        return position_ids

    g = torch.Generator().manual_seed(0)
    for eod_rate in (0.0, 0.1, 0.5):
        tokens = torch.randint(1, 50, (64,), generator=g)
        tokens[torch.rand(64, generator=g) < eod_rate] = 0
        tokens[0] = 0 if eod_rate == 0.5 else tokens[0]  # an eod first, and one last below
        tokens[-1] = 0
        assert torch.equal(positions_restarting_after(tokens, 0), megatron_loop(tokens, 0))
    assert positions_restarting_after(torch.tensor([5, 0, 7, 8, 0, 0, 9]), 0).tolist() == [0, 1, 0, 1, 2, 0, 0]

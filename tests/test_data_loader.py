"""Sampler, loaders and get_batch: DP-size-independent global batches, resume, TP broadcast on real ranks."""

import numpy as np
import pytest
import torch

from megalm.config import MegalmConfig
from megalm.data import build_train_valid_test_data_iterators, get_batch, splits_available
from megalm.data.builder import build_train_valid_test_datasets
from megalm.data.indexed_dataset import IndexedDatasetBuilder
from megalm.data.samplers import MegatronPretrainingSampler
from megalm.testing import run_distributed
from megalm.tokenizers import NullTokenizer

VOCAB = 1000


def global_batches(dp_size, mbs=2, gbs=8, consumed=0, total=64):
    """Global batches (sorted sample ids) assembled from every DP rank's micro-batches."""
    per_rank = [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp_size)) for r in range(dp_size)]
    micro_per_step = gbs // (mbs * dp_size)
    steps = len(per_rank[0]) // micro_per_step
    out = []
    for k in range(steps):
        ids = [i for r in range(dp_size) for m in per_rank[r][k * micro_per_step:(k + 1) * micro_per_step] for i in m]
        out.append(sorted(ids))
    return out


def test_global_batch_is_independent_of_dp_size():
    ref = global_batches(1)
    assert ref[0] == list(range(8)) and ref[3] == list(range(24, 32)) and len(ref) == 8
    assert global_batches(2) == ref and global_batches(4) == ref
    # Rank slices: DP 2, micro-batch 2 -> rank 1 gets samples 2,3 then 6,7 of each global batch.
    assert list(MegatronPretrainingSampler(16, 0, 2, 1, 2)) == [[2, 3], [6, 7], [10, 11], [14, 15]]


def test_resume_from_consumed_samples_continues_exactly():
    full = list(MegatronPretrainingSampler(100, 0, 3, 1, 2))
    resumed = list(MegatronPretrainingSampler(100, 24, 3, 1, 2))
    assert resumed == full[4:]
    assert global_batches(4, consumed=16) == global_batches(1)[2:]
    sampler = MegatronPretrainingSampler(100, 24, 3, 1, 2)
    assert len(sampler) == len(resumed) == (100 - 24) // 6
    assert list(MegatronPretrainingSampler(10, 10, 2, 0, 1)) == []
    with pytest.raises(ValueError, match="consumed_samples 11"):
        MegatronPretrainingSampler(10, 11, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)


def write_numbered_dataset(prefix, num_docs=300):
    """Documents of increasing ids (so a sample's tokens identify it), each ending in eod."""
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as b:
        for d in range(num_docs):
            n = int(rng.integers(3, 40))
            b.add_item(list((np.arange(n) + d) % (VOCAB - 1)) + [VOCAB])
            b.end_document()
        b.finalize()
    return str(prefix)


def make_cfg(prefix, seq=16, mbs=2, gbs=8, iters=20, workers=0):
    cfg = MegalmConfig()
    cfg.model.seq_length = seq
    cfg.training.micro_batch_size, cfg.training.global_batch_size, cfg.training.train_iters = mbs, gbs, iters
    cfg.training.eval_interval, cfg.training.eval_iters = 10, 3
    cfg.data.data_path = [prefix] if prefix else None
    cfg.data.mock_data = prefix is None
    cfg.data.num_workers = workers
    cfg.data.split = "90,8,2"
    return cfg


def test_iterators_single_process_resume_workers_and_cyclic_valid(tmp_path):
    prefix = write_numbered_dataset(tmp_path / "ds")
    tok = NullTokenizer(VOCAB)
    cfg = make_cfg(prefix)
    train, valid, test = build_train_valid_test_data_iterators(cfg, tok, 0, 0)
    batches = [get_batch(train) for _ in range(12)]
    assert set(batches[0]) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batches[0]["tokens"].shape == (2, 16) and batches[0]["tokens"].dtype == torch.int64
    assert torch.equal(batches[0]["tokens"][:, 1:], batches[0]["labels"][:, :-1])
    train_ds = build_train_valid_test_datasets(cfg, tok)[0]
    assert torch.equal(batches[5]["tokens"][1], train_ds[11]["tokens"])  # micro-batch 5 = samples 10, 11
    # Resume after 3 global batches (12 samples = 6 micro-batches), with 2 loader workers.
    resumed, _, _ = build_train_valid_test_data_iterators(make_cfg(prefix, workers=2), tok, 12, 0)
    for expected in batches[6:]:
        got = get_batch(resumed)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    # Valid: cyclic; wraps to its start.
    valid_ds = build_train_valid_test_datasets(cfg, tok)[1]
    n_valid = len(valid_ds) // 2
    first = [get_batch(valid)["tokens"] for _ in range(n_valid)]
    assert torch.equal(get_batch(valid)["tokens"], first[0])
    assert test is not None and get_batch(test)["tokens"].shape == (2, 16)


def test_mock_data_iterators():
    cfg = make_cfg(None)
    tok = NullTokenizer(64)
    a = build_train_valid_test_data_iterators(cfg, tok)[0]
    b = build_train_valid_test_data_iterators(cfg, tok)[0]
    for _ in range(3):
        x, y = get_batch(a), get_batch(b)
        assert torch.equal(x["tokens"], y["tokens"]) and int(x["tokens"].max()) <= 64


# --- real ranks ------------------------------------------------------------------------

LAYOUTS = (("dp4", 1, 1), ("tp2", 2, 1), ("tp4", 4, 1), ("tp2pp2", 2, 2))


def _ranks_read_and_broadcast(prefix):
    """On each of 4 ranks: for every layout, the data built/loaded and 2 global batches of micro-batches."""
    import torch.distributed as dist

    from megalm import parallel_state as ps
    from megalm.data.loaders import rank_reads_data

    tok = NullTokenizer(VOCAB)
    out = {}
    for name, tp, pp in LAYOUTS:
        ps.initialize_model_parallel(tp, pp)
        cfg = make_cfg(prefix)
        train_ds = build_train_valid_test_datasets(cfg, tok, rank_reads_data())[0]
        train, valid, test = build_train_valid_test_data_iterators(cfg, tok, consumed_train_samples=8)
        dp = ps.get_data_parallel_world_size()
        micro = [get_batch(train, cfg) for _ in range(2 * 8 // (2 * dp))]
        splits = splits_available()
        out[name] = {"built": None if train_ds is None else bool(train_ds.built_indices), "reads": train is not None,
                     "splits": splits,
                     "valid_none": valid is None, "dp_rank": ps.get_data_parallel_rank(), "dp": dp,
                     "tp_rank": ps.get_tensor_model_parallel_rank(), "first": ps.is_pipeline_first_stage(),
                     "last": ps.is_pipeline_last_stage(),
                     "micro": [{k: (None if v is None else v.tolist()) for k, v in m.items()} for m in micro]}
        dist.barrier()
        ps.destroy_model_parallel()
    return out


def test_real_ranks_dp_independent_batches_and_tp_broadcast(tmp_path):
    prefix = write_numbered_dataset(tmp_path / "ds")
    results = run_distributed(_ranks_read_and_broadcast, 4, args=(prefix,), timeout=150)
    tok = NullTokenizer(VOCAB)
    train_ds = build_train_valid_test_datasets(make_cfg(prefix), tok)[0]
    expected = lambda i: train_ds[i]  # noqa: E731 - sample i of the training set

    # DP 4: rank 0 built the indices, the others loaded them after the barrier.
    assert [r["dp4"]["built"] for r in results] == [True, False, False, False]
    for name, tp, pp in LAYOUTS:
        dp = 4 // (tp * pp)
        for rank, r in enumerate(results):
            info = r[name]
            assert info["reads"] == (info["tp_rank"] == 0) and info["dp"] == dp
            assert info["splits"] == (True, True, True)
            for m, batch in enumerate(info["micro"]):
                if not info["first"] and not info["last"]:
                    assert batch == dict.fromkeys(batch) and len(batch) == 4
                    continue
                # Micro-step m covers samples 8 + m*2*dp ..; this rank's slice starts at dp_rank*2.
                ids = [8 + m * 2 * dp + info["dp_rank"] * 2 + j for j in range(2)]
                if info["first"]:
                    assert batch["tokens"] == [expected(i)["tokens"].tolist() for i in ids], (name, rank, m)
                    assert batch["position_ids"] == [list(range(16))] * 2
                else:
                    assert batch["tokens"] is None and batch["position_ids"] is None
                if info["last"]:
                    assert batch["labels"] == [expected(i)["labels"].tolist() for i in ids], (name, rank, m)
                    assert batch["loss_mask"] == [expected(i)["loss_mask"].tolist() for i in ids]
                else:
                    assert batch["labels"] is None and batch["loss_mask"] is None
    # TP broadcast: every TP rank of a group holds exactly its TP rank 0's batch.
    assert results[1]["tp2"]["micro"] == results[0]["tp2"]["micro"]
    assert results[3]["tp4"]["micro"] == results[0]["tp4"]["micro"]
    assert results[3]["tp2pp2"]["micro"] == results[2]["tp2pp2"]["micro"]


def test_splits_available_reports_empty_splits():
    cfg = make_cfg(None)
    cfg.data.split = "100,0,0"
    train, valid, test = build_train_valid_test_data_iterators(cfg, NullTokenizer(64))
    assert splits_available() == (True, False, False)
    assert train is not None and valid is None and test is None

"""Sampler, loaders and get_batch: DP-size-independent global batches, resume, TP broadcast on real ranks."""

import numpy as np
import pytest
import torch

from megalm.config import ConfigError
from megalm.data import build_train_valid_test_data_iterators, splits_available
from megalm.data.builder import build_train_valid_test_datasets
from megalm.data.indexed_dataset import IndexedDatasetBuilder
from megalm.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler, epoch_generator_seed
from megalm.parallel_state import ProcessGroups
from megalm.tokenizers import NullTokenizer
from megalm.training import get_batch
from tests.configs import make_config
from tests.distributed_harness import run_distributed
from tests.test_reset_attention_mask import megatron_mask

ONE = ProcessGroups.single()  # a model of one process

VOCAB = 1000


def global_batches(dp_size, mbs=2, gbs=8, consumed=0, total=64):
    """Global batches (sorted sample ids) assembled from every DP rank's micro-batches."""
    per_rank = [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp_size)) for r in range(dp_size)]
    micro_per_step = gbs // (mbs * dp_size)
    steps = len(per_rank[0]) // micro_per_step
    out = []
    for k in range(steps):
        ids = [i for r in range(dp_size) for m in per_rank[r][k * micro_per_step : (k + 1) * micro_per_step] for i in m]
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


# The batch, evaluation and split settings of these tests (not validated: the loaders read the config as is);
# the tests add a corpus (--data-path) or --mock-data.
BATCHES = dict(seq_length=16, micro_batch_size=2, global_batch_size=8, train_iters=20, eval_interval=10, eval_iters=3)
BATCHES.update(num_workers=0, split="90,8,2")


def test_iterators_single_process_resume_workers_and_cyclic_valid(tmp_path):
    prefix = write_numbered_dataset(tmp_path / "ds")
    tok = NullTokenizer(VOCAB)
    cfg = make_config(BATCHES, data_path=[prefix], validate=False)
    train, valid, test = build_train_valid_test_data_iterators(cfg, tok, 0, 0, groups=ONE)
    batches = [get_batch(train, None, ONE) for _ in range(12)]
    assert set(batches[0]) == {"tokens", "labels", "loss_mask", "position_ids", "attention_mask", "packed_seq_params"}
    assert batches[0]["attention_mask"] is None  # causal unless --reset-attention-mask
    assert batches[0]["packed_seq_params"] is None  # unless --qkv-format thd
    assert batches[0]["tokens"].shape == (2, 16) and batches[0]["tokens"].dtype == torch.int64
    assert torch.equal(batches[0]["tokens"][:, 1:], batches[0]["labels"][:, :-1])
    train_ds = build_train_valid_test_datasets(cfg, tok)[0]
    assert torch.equal(batches[5]["tokens"][1], train_ds[11]["tokens"])  # micro-batch 5 = samples 10, 11
    # Resume after 3 global batches (12 samples = 6 micro-batches), with 2 loader workers.
    resumed, _, _ = build_train_valid_test_data_iterators(
        make_config(BATCHES, data_path=[prefix], num_workers=2, validate=False), tok, 12, 0, groups=ONE
    )
    for expected in batches[6:]:
        got = get_batch(resumed, None, ONE)
        assert all(torch.equal(got[k], expected[k]) for k in expected if expected[k] is not None)
    # Valid: cyclic; wraps to its start.
    valid_ds = build_train_valid_test_datasets(cfg, tok)[1]
    n_valid = len(valid_ds) // 2
    first = [get_batch(valid, None, ONE)["tokens"] for _ in range(n_valid)]
    assert torch.equal(get_batch(valid, None, ONE)["tokens"], first[0])
    assert test is not None and get_batch(test, None, ONE)["tokens"].shape == (2, 16)


def test_mock_data_iterators():
    cfg = make_config(BATCHES, mock_data=True, validate=False)
    tok = NullTokenizer(64)
    a = build_train_valid_test_data_iterators(cfg, tok, groups=ONE)[0]
    b = build_train_valid_test_data_iterators(cfg, tok, groups=ONE)[0]
    for _ in range(3):
        x, y = get_batch(a, None, ONE), get_batch(b, None, ONE)
        assert torch.equal(x["tokens"], y["tokens"]) and int(x["tokens"].max()) <= 64


# --- real ranks ------------------------------------------------------------------------

LAYOUTS = (("dp4", 1, 1), ("tp2", 2, 1), ("tp4", 4, 1), ("tp2pp2", 2, 2), ("pp4docs", 1, 4))


def _ranks_read_and_broadcast(prefix):
    """On each of 4 ranks: for every layout, the data built/loaded and 2 global batches of micro-batches."""
    import torch.distributed as dist

    from megalm import parallel_state as ps
    from megalm.data.loaders import rank_reads_data

    tok = NullTokenizer(VOCAB)
    out = {}
    for name, tp, pp in LAYOUTS:
        ps.initialize_model_parallel(tp, pp)
        cfg = make_config(BATCHES, data_path=[prefix], validate=False)
        cfg.data.reset_attention_mask = name.endswith("docs")  # every stage needs the documents
        groups = ps.get_process_groups()
        train_ds = build_train_valid_test_datasets(cfg, tok, rank_reads_data(groups, cfg.data.reset_attention_mask))[0]
        iterators = build_train_valid_test_data_iterators(cfg, tok, consumed_train_samples=8, groups=groups)
        train, valid, test = iterators
        dp = ps.get_data_parallel_world_size()
        micro = [get_batch(train, cfg, groups) for _ in range(2 * 8 // (2 * dp))]
        splits = splits_available(iterators)
        out[name] = {
            "built": None if train_ds is None else bool(train_ds.built_indices),
            "reads": train is not None,
            "splits": splits,
            "valid_none": valid is None,
            "dp_rank": ps.get_data_parallel_rank(),
            "dp": dp,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "first": ps.is_pipeline_first_stage(),
            "last": ps.is_pipeline_last_stage(),
            "micro": [{k: (None if v is None else v.tolist()) for k, v in m.items()} for m in micro],
        }
        dist.barrier()
        ps.destroy_model_parallel()
    return out


def test_real_ranks_dp_independent_batches_and_tp_broadcast(tmp_path):
    prefix = write_numbered_dataset(tmp_path / "ds")
    results = run_distributed(_ranks_read_and_broadcast, 4, args=(prefix,), timeout=150)
    tok = NullTokenizer(VOCAB)
    train_ds = build_train_valid_test_datasets(make_config(BATCHES, data_path=[prefix], validate=False), tok)[0]
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
                # Micro-step m covers samples 8 + m*2*dp ..; this rank's slice starts at dp_rank*2.
                ids = [8 + m * 2 * dp + info["dp_rank"] * 2 + j for j in range(2)]
                if name.endswith("docs"):  # every stage: the document mask of its samples
                    tokens = torch.stack([expected(i)["tokens"] for i in ids])
                    assert batch["attention_mask"] == megatron_mask(tokens, VOCAB).tolist(), (rank, m)
                else:
                    assert batch["attention_mask"] is None
                if not info["first"] and not info["last"]:
                    assert {k for k, v in batch.items() if v is not None} <= {"attention_mask"} and len(batch) == 6
                    continue
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


def _get_batch_without_cfg_under_model_parallelism():
    from megalm import parallel_state as ps
    from megalm.data.batch import BatchError

    ps.initialize_model_parallel(1, 1)
    try:
        batch = {k: torch.zeros(2, 16, dtype=torch.int64) for k in ("tokens", "labels", "position_ids")}
        batch["loss_mask"] = torch.ones(2, 16)
        with pytest.raises(BatchError, match=r"get_batch needs cfg"):
            get_batch(iter([batch]), None, ps.get_process_groups())
        cfg = make_config(BATCHES, mock_data=True, validate=False)
        return get_batch(iter([batch]), cfg, ps.get_process_groups())["tokens"].shape
    finally:
        ps.destroy_model_parallel()


def test_get_batch_needs_the_config_not_a_remembered_shape():
    """No module-level batch shape: under model parallelism the shape comes from cfg."""
    assert run_distributed(_get_batch_without_cfg_under_model_parallelism, 1, timeout=60) == [(2, 16)]


def test_splits_available_reports_empty_splits():
    cfg = make_config(BATCHES, mock_data=True, validate=False)
    cfg.data.split = "100,0,0"
    iterators = build_train_valid_test_data_iterators(cfg, NullTokenizer(64), groups=ONE)
    train, valid, test = iterators
    assert splits_available(iterators) == (True, False, False)
    assert train is not None and valid is None and test is None


# --- --dataloader-type cyclic: MegatronPretrainingRandomSampler -------------------------------


def random_sampler(total, consumed, mbs, rank, dp, sharding=True, seed=1234):
    return MegatronPretrainingRandomSampler(total, consumed, mbs, rank, dp, data_sharding=sharding, seed=seed)


def rank_sequences(total, mbs, dp, epochs, consumed=0, sharding=True, seed=1234):
    """Each rank's micro-batches over ``epochs`` passes of one sampler (as a cyclic iterator reads them)."""
    out = []
    for rank in range(dp):
        sampler = random_sampler(total, consumed, mbs, rank, dp, sharding, seed)
        out.append([m for _ in range(epochs) for m in sampler])
    return out


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("total, mbs, dp", [(50, 2, 1), (50, 3, 2), (53, 2, 4), (14, 2, 4), (7, 1, 2)])
def test_random_sampler_epoch_is_a_permutation_split_over_ranks(total, mbs, dp, sharding):
    step = mbs * dp
    epoch_samples = total - total % step  # the last incomplete step is dropped
    per_rank = rank_sequences(total, mbs, dp, 1, sharding=sharding)
    for rank, batches in enumerate(per_rank):
        assert len(batches) == epoch_samples // step and all(len(m) == mbs for m in batches)
        ids = [i for m in batches for i in m]
        assert len(set(ids)) == len(ids)  # no sample twice in an epoch
        if sharding:  # rank r shuffles exactly its own contiguous bucket
            bucket = epoch_samples // dp
            assert sorted(ids) == list(range(rank * bucket, (rank + 1) * bucket))
    for k in range(epoch_samples // step):  # one step over all ranks: mbs x dp distinct samples
        step_ids = [i for rank in range(dp) for i in per_rank[rank][k]]
        assert len(set(step_ids)) == step
    union = [i for batches in per_rank for m in batches for i in m]
    assert len(set(union)) == epoch_samples and all(0 <= i < total for i in union)
    if epoch_samples // dp >= 8:  # shuffled
        assert all([i for m in batches for i in m] != sorted(i for m in batches for i in m) for batches in per_rank)


def test_random_sampler_global_steps_without_sharding_are_dp_independent_prefixes():
    """Without sharding, step k over the ranks is samples perm[k*step:(k+1)*step] of the epoch's permutation."""
    one = [i for m in rank_sequences(48, 2, 1, 1, sharding=False)[0] for i in m]
    four = rank_sequences(48, 2, 4, 1, sharding=False)
    for k in range(6):
        assert sorted(i for rank in range(4) for i in four[rank][k]) == sorted(one[8 * k : 8 * (k + 1)])


def test_random_sampler_order_depends_on_seed_and_epoch():
    a = rank_sequences(40, 2, 2, 2, seed=7)
    assert rank_sequences(40, 2, 2, 2, seed=7) == a  # deterministic
    for other in (0, 8, 1235, 2**31 - 1):
        assert rank_sequences(40, 2, 2, 2, seed=other) != a
    # Generator seeds (torch keeps 32 bits): seeds s1 != s2 in [0, 2**16) can share one only for epochs
    # 52,777 or more apart, as (s2 - s1) * 0x9E3779B9 is at least that far from 0 modulo 2**32.
    d = np.arange(1, 2**16, dtype=np.uint64)
    residue = (d * np.uint64(0x9E3779B9)) % np.uint64(2**32)
    assert np.minimum(residue, np.uint64(2**32) - residue).min() == 52777
    assert epoch_generator_seed(0, 3) == 3 and epoch_generator_seed(1234, 2**32) == epoch_generator_seed(1234, 0)
    for rank in range(2):
        first, second = a[rank][:10], a[rank][10:]
        assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))  # same bucket, new order
    # --seed 0: Megatron's permutation (torch.randperm seeded by the epoch alone), here epoch 1 of rank 1's bucket.
    sampler = random_sampler(40, 40, 2, 1, 2, seed=0)
    expected = (20 + torch.randperm(20, generator=torch.Generator().manual_seed(1))).tolist()
    assert [i for m in sampler for i in m] == expected


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_resume_continues_the_same_sequence(sharding):
    total, mbs, dp = 45, 2, 3  # step 6, epoch 42 samples = 7 steps
    full = rank_sequences(total, mbs, dp, 3, sharding=sharding)
    for consumed in (0, 6, 18, 36, 42, 48, 84, 96):
        resumed = rank_sequences(total, mbs, dp, 2, consumed=consumed, sharding=sharding)
        k = consumed // 6
        for rank in range(dp):
            tail = full[rank][k:]
            got = resumed[rank][: len(tail)]  # first iter(): the rest of the epoch; then whole epochs
            assert got == tail[: len(got)] and len(got) >= min(len(tail), 7), (consumed, rank)
    sampler = random_sampler(total, 18, mbs, 0, dp, sharding)
    assert sampler.epoch_and_offset() == (0, 18) and len(sampler) == 4
    assert len(list(sampler)) == 4 and sampler.consumed_samples == 42 and len(sampler) == 7
    assert sampler.epoch_and_offset() == (1, 0)


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 0, 0, 0, 1), "micro_batch_size must be >= 1, got 0"),
        ((10, 0, 2, 0, 0), "data_parallel_size must be >= 1, got 0"),
        ((10, 0, 2, 2, 2), "data_parallel_rank 2 is outside \\[0, 2\\)"),
        ((7, 0, 2, 0, 4), "total_samples 7 is less than one step of micro_batch_size x data_parallel_size = 8"),
        ((0, 0, 1, 0, 1), "total_samples 0 is less than one step"),
        ((10, -2, 2, 0, 1), "consumed_samples must be >= 0, got -2"),
        ((20, 6, 2, 0, 2), "consumed_samples 6 is not a multiple of micro_batch_size x data_parallel_size = 4"),
    ],
)
def test_random_sampler_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingRandomSampler(*args)


def test_dataloader_type_flag_parses(capsys):
    from megalm.config import parse_config

    assert parse_config([]).data.dataloader_type == "single" and parse_config([]).data.data_sharding is True
    cfg = parse_config(["--dataloader-type", "cyclic", "--no-data-sharding"])
    assert cfg.data.dataloader_type == "cyclic" and cfg.data.data_sharding is False
    with pytest.raises(ConfigError) as e:
        parse_config(["--dataloader-type", "external"])
    assert "invalid choice: 'external'" in str(e.value)


def test_cyclic_iterators_shuffle_wrap_epochs_and_resume(tmp_path):
    prefix = write_numbered_dataset(tmp_path / "ds")
    tok = NullTokenizer(VOCAB)
    cfg = make_config(BATCHES, data_path=[prefix], validate=False)
    cfg.data.dataloader_type, cfg.training.seed = "cyclic", 5
    train_ds, valid_ds, _ = build_train_valid_test_datasets(cfg, tok)
    sampler = random_sampler(len(train_ds), 0, 2, 0, 1, seed=5)
    per_epoch = len(sampler)
    expected = [m for _ in range(2) for m in sampler]  # two epochs of sample ids
    train, valid, test = build_train_valid_test_data_iterators(cfg, tok, 0, 0, groups=ONE)
    n = per_epoch + 3  # past the end of the first epoch
    got = [get_batch(train, None, ONE)["tokens"] for _ in range(n)]
    for batch, ids in zip(got, expected):
        assert torch.equal(batch, torch.stack([train_ds[i]["tokens"] for i in ids]))
    assert [i for m in expected[:per_epoch] for i in m] != list(range(2 * per_epoch))  # shuffled
    # Resume after 3 global batches (12 samples), with 2 workers, across the epoch boundary.
    cfg.data.num_workers = 2
    resumed, _, _ = build_train_valid_test_data_iterators(cfg, tok, 12, 0, groups=ONE)
    for batch in got[6:]:
        assert torch.equal(get_batch(resumed, None, ONE)["tokens"], batch)
    # Valid and test are cyclic too (as Megatron's): valid from its consumed samples, into a new epoch.
    valid_sampler = random_sampler(len(valid_ds), 4, 2, 0, 1, seed=5)
    valid_ids = [m for _ in range(2) for m in valid_sampler][: len(valid_ds) // 2 + 1]
    cfg.data.num_workers = 0
    valid = build_train_valid_test_data_iterators(cfg, tok, 0, 4, groups=ONE)[1]
    for ids in valid_ids:
        assert torch.equal(get_batch(valid, None, ONE)["tokens"], torch.stack([valid_ds[i]["tokens"] for i in ids]))
    assert all(
        get_batch(test, None, ONE)["tokens"].shape == (2, 16) for _ in range(20)
    )  # more than the test split holds

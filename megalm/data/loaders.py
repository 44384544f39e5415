"""Data loaders and the one entry point the trainer calls.

:func:`build_train_valid_test_data_iterators` builds the datasets collectively (rank 0
first, cached, then the others), and returns iterators of micro-batch dicts on the ranks
that read data: tensor-parallel rank 0 of the first and last pipeline stages.  Every
other rank gets ``None`` and receives its batches through :func:`megalm.data.get_batch`.
:func:`splits_available` then tells every rank which splits have data (as Megatron's
``do_train`` / ``do_valid`` / ``do_test`` flags), since only reading ranks can see it.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megalm import parallel_state as ps
from megalm.data import batch as batch_module
from megalm.data.builder import build_train_valid_test_datasets, get_train_valid_test_num_samples
from megalm.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from megalm.device import get_device


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                                  data_parallel_size: int, num_workers: int = 0, dataloader_type: str = "single",
                                  seed: int = 0, data_sharding: bool = True) -> Optional[torch.utils.data.DataLoader]:
    """DataLoader over this rank's micro-batches of ``dataset`` starting at ``consumed_samples``.

    ``dataloader_type`` "single": in order (:class:`MegatronPretrainingSampler`); "cyclic": the
    rest of the current shuffled epoch, the next epoch on each new ``iter()``
    (:class:`MegatronPretrainingRandomSampler` seeded by ``seed``, with ``data_sharding``).
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                             data_parallel_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(len(dataset), consumed_samples, micro_batch_size,
                                                   data_parallel_rank, data_parallel_size, data_sharding, seed)
    else:
        raise ValueError(f"dataloader_type must be 'single' or 'cyclic', got {dataloader_type!r}")
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=get_device().type == "cuda", persistent_workers=num_workers > 0)


def cyclic_iter(iterable) -> Iterator:
    """Iterate ``iterable`` again from its start each time it is exhausted."""
    while True:
        yielded = False
        for x in iterable:
            yielded = True
            yield x
        if not yielded:
            return


def rank_reads_data() -> bool:
    """TP rank 0 of the first or last pipeline stage (every rank without model parallelism)."""
    if not ps.model_parallel_is_initialized():
        return True
    return ps.get_tensor_model_parallel_rank() == 0 and (
        ps.is_pipeline_first_stage(ignore_virtual=True) or ps.is_pipeline_last_stage(ignore_virtual=True))


def data_parallel_rank_and_size() -> Tuple[int, int]:
    if ps.model_parallel_is_initialized():
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_SPLITS_AVAILABLE: Optional[Tuple[bool, bool, bool]] = None


def _share_split_flags(local: list) -> None:
    """Agree on which splits exist: OR of the reading ranks' answers (collective)."""
    global _SPLITS_AVAILABLE
    flags = torch.tensor([int(x) for x in local], dtype=torch.int64, device=get_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    _SPLITS_AVAILABLE = tuple(bool(x) for x in flags.tolist())


def splits_available() -> Tuple[bool, bool, bool]:
    """``(train, valid, test)``: whether each split has data, the same on every rank.

    Valid after :func:`build_train_valid_test_data_iterators`; use it to decide whether
    to train / evaluate (ranks that do not read data get None iterators either way).
    """
    if _SPLITS_AVAILABLE is None:
        raise RuntimeError("splits_available() is known only after build_train_valid_test_data_iterators()")
    return _SPLITS_AVAILABLE


def build_train_valid_test_data_iterators(cfg, tokenizer, consumed_train_samples: int = 0,
                                          consumed_valid_samples: int = 0):
    """``(train_iter, valid_iter, test_iter)`` of micro-batch dicts; None on ranks that do not read.

    Collective: every rank calls it.  ``--dataloader-type single``: the valid iterator is
    cyclic (each evaluation goes on where the last stopped, and wraps around), the train and
    test ones are not.  ``cyclic`` (as Megatron): all three shuffle and re-iterate endlessly,
    the valid one from ``consumed_valid_samples`` (the sampler derives the epoch from it).
    """
    batch_module.set_batch_shape(cfg.training.micro_batch_size, cfg.model.seq_length)
    reads = rank_reads_data()
    num_samples = get_train_valid_test_num_samples(cfg)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg, tokenizer, reads, num_samples)
    _share_split_flags([ds is not None for ds in (train_ds, valid_ds, test_ds)])
    if not reads:
        return None, None, None
    dp_rank, dp_size = data_parallel_rank_and_size()
    mbs, workers, kind = cfg.training.micro_batch_size, cfg.data.num_workers, cfg.data.dataloader_type

    def loader(ds, consumed):
        return build_pretraining_data_loader(ds, consumed, mbs, dp_rank, dp_size, workers, kind,
                                             cfg.training.seed, cfg.data.data_sharding)

    def iterate(dl, cyclic):
        return None if dl is None else iter(cyclic_iter(dl)) if cyclic else iter(dl)

    cyclic = kind == "cyclic"
    train = loader(train_ds, consumed_train_samples)
    # single: the valid set is cycled, so a count beyond its size wraps around.
    wrapped_valid = consumed_valid_samples if cyclic or valid_ds is None else consumed_valid_samples % len(valid_ds)
    valid = loader(valid_ds, wrapped_valid)
    test = loader(test_ds, 0)
    return iterate(train, cyclic), iterate(valid, True), iterate(test, cyclic)

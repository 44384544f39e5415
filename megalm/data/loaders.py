"""Data loaders and the one entry point the trainer calls.

:func:`build_train_valid_test_data_iterators` builds the datasets collectively (rank 0
first, cached, then the others), and returns iterators of micro-batch dicts on the ranks
that read data: tensor-parallel rank 0 of the first and last pipeline stages (of every stage with
``--reset-attention-mask``).  Every
other rank gets ``None`` and receives its batches through :func:`megalm.training.get_batch`.
The returned :class:`DataIterators` also tells every rank which splits have data
(``.splits``, as Megatron's ``do_train`` / ``do_valid`` / ``do_test`` flags), since only
reading ranks can see it; :func:`splits_available` reads it.  Nothing is kept at module level.

DataLoader workers are started by a ``forkserver`` (:func:`worker_context`), never forked from the
trainer: by the time the loaders start, the trainer runs threads (gloo, the watchdogs, the
profiler), and a child forked while another thread held a lock (logging's, the allocator's) inherits
it locked and can hang in Python's after-fork code (issue #32: about one launch in 90 hung so with
``--num-workers 2``).  The forkserver is a fresh single-threaded interpreter that has imported torch;
each worker receives the dataset pickled (memory-mapped indices as file references:
:class:`megalm.data.index_cache.PicklesMappedArrays`) and stays alive for the run
(``persistent_workers``).  Which sample each worker reads is decided by the sampler in the trainer,
so the batches are the same as with fork or without workers.

Two things keep restarts exact and ``--exit-signal-handler`` working (issue #18):

* every DataLoader draws its workers' base seed from its own generator, never from torch's
  default one: only the reading ranks iterate loaders, so drawing from the default generator
  would move it on TP rank 0 alone and give the TP ranks different dropout masks for
  replicated activations (on a CPU the default generator is also the dropout stream);
* DataLoader workers ignore SIGTERM (:func:`ignore_sigterm_in_worker`): Slurm and torchrun
  signal the whole process group, and a worker killed first takes the trainer down before it
  can save.  Workers still exit with their main process (the DataLoader's sentinel at
  shutdown, or its watchdog when the main process is gone).
"""

from __future__ import annotations

import multiprocessing
import signal
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.data.batch import positions_on_every_stage
from megalm.data.builder import build_train_valid_test_datasets, get_train_valid_test_num_samples
from megalm.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler, ShareSampler
from megalm.device import get_device
from megalm.parallel_state import ProcessGroups, group_rank, group_size


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    dataloader_type: str = "single",
    seed: int = 0,
    data_sharding: bool = True,
    shares: Optional[Sequence[int]] = None,
) -> Optional[torch.utils.data.DataLoader]:
    """DataLoader over this rank's micro-batches of ``dataset`` starting at ``consumed_samples``.

    ``dataloader_type`` "single": in order (:class:`MegatronPretrainingSampler`); "cyclic": the
    rest of the current shuffled epoch, the next epoch on each new ``iter()``
    (:class:`MegatronPretrainingRandomSampler` seeded by ``seed``, with ``data_sharding``).
    """
    if dataset is None:
        return None
    if shares is not None:  # --straggler-rebalance-interval: uneven micro-batch counts per replica
        if dataloader_type != "single":
            raise ValueError("micro-batch shares need dataloader_type 'single'")
        sampler = ShareSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, shares)
    elif dataloader_type == "single":
        sampler = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            len(dataset),
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            data_sharding,
            seed,
        )
    else:
        raise ValueError(f"dataloader_type must be 'single' or 'cyclic', got {dataloader_type!r}")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=get_device().type == "cuda",
        persistent_workers=num_workers > 0,
        multiprocessing_context=worker_context() if num_workers > 0 else None,
        worker_init_fn=ignore_sigterm_in_worker if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )


WORKER_PRELOAD = ["torch", "megalm.data.loaders"]


def worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of DataLoader workers: ``forkserver`` (``spawn`` where there is
    none).  The server process starts once per trainer, from a fresh interpreter that imports
    :data:`WORKER_PRELOAD` (torch and this module), so each worker is a cheap fork of a
    single-threaded process rather than of the multi-threaded trainer."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts (the first loader)
    return context


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """``worker_init_fn``: a DataLoader worker ignores SIGTERM, so a SIGTERM sent to the whole
    process group (Slurm, torchrun) reaches the trainer's ``--exit-signal-handler`` while the
    workers keep serving batches until it has saved.  The DataLoader still stops its workers
    at shutdown (sentinel), and a worker whose main process is gone exits by its watchdog."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def cyclic_iter(iterable) -> Iterator:
    """Iterate ``iterable`` again from its start each time it is exhausted."""
    while True:
        yielded = False
        for x in iterable:
            yielded = True
            yield x
        if not yielded:
            return


def rank_reads_data(groups: ProcessGroups, every_stage: bool = False) -> bool:
    """TP rank 0 of the first or last pipeline stage, or of every stage with ``every_stage``
    (``--reset-attention-mask``: each stage's attention needs the documents; ``--reset-position-ids``
    with RoPE: each stage's rotation needs the positions); every rank of a model of one process
    (``groups`` of :meth:`ProcessGroups.single`)."""
    pp_rank, pp = group_rank(groups.pp), group_size(groups.pp)
    return group_rank(groups.tp) == 0 and (every_stage or pp_rank == 0 or pp_rank == pp - 1)


def data_parallel_rank_and_size(groups: ProcessGroups) -> Tuple[int, int]:
    """This rank's index in ``groups.dp`` and its size (the samplers' shard)."""
    return group_rank(groups.dp), group_size(groups.dp)


def _share_split_flags(local: list) -> Tuple[bool, bool, bool]:
    """Agree on which splits exist: OR of the reading ranks' answers (one all-reduce, MAX, over
    the world)."""
    flags = torch.tensor([int(x) for x in local], dtype=torch.int64, device=get_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return tuple(bool(x) for x in flags.tolist())


class DataIterators(tuple):
    """``(train_iter, valid_iter, test_iter)`` (unpacks as a tuple) and ``splits``: whether
    each split has data, ``(train, valid, test)``, the same on every rank; ``loaders``: the
    DataLoaders behind the iterators, for :meth:`close`."""

    def __new__(cls, train, valid, test, splits: Tuple[bool, bool, bool], loaders: Sequence = ()):
        obj = super().__new__(cls, (train, valid, test))
        obj.splits = splits
        obj.loaders = tuple(dl for dl in loaders if dl is not None)
        obj.train_loader = loaders[0] if loaders else None
        return obj

    def close(self) -> None:
        """Stop the loaders' worker processes now (:func:`shutdown_loader_workers`)."""
        for dl in self.loaders:
            shutdown_loader_workers(dl)


def shutdown_loader_workers(loader: torch.utils.data.DataLoader) -> None:
    """Stop the persistent worker processes of ``loader`` (sentinel, then join), as the DataLoader
    does when its iterator is garbage collected.  A run that ends with an exception must call it:
    the traceback keeps the iterator alive past interpreter shutdown, where multiprocessing's exit
    handler SIGTERMs the workers, which ignore it (:func:`ignore_sigterm_in_worker`), and then
    joins them forever (a hung rank instead of a failed one).  The workers' iterator
    (``loader._iterator``, torch's) raises if used again; a loader without workers has none."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def splits_available(iterators: DataIterators) -> Tuple[bool, bool, bool]:
    """``(train, valid, test)``: whether each split has data, the same on every rank; use it to
    decide whether to train / evaluate (ranks that do not read data get None iterators either
    way).  ``iterators``: what :func:`build_train_valid_test_data_iterators` returned."""
    return iterators.splits


def build_train_valid_test_data_iterators(
    cfg,
    tokenizer,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    *,
    groups: ProcessGroups,
    train_iters: Optional[int] = None,
    train_shares: Optional[Sequence[int]] = None,
) -> DataIterators:
    """``(train_iter, valid_iter, test_iter)`` of micro-batch dicts; None on ranks that do not read.

    Collective: every rank calls it.  ``--dataloader-type single``: the valid iterator is
    cyclic (each evaluation goes on where the last stopped, and wraps around), the train and
    test ones are not.  ``cyclic`` (as Megatron): all three shuffle and re-iterate endlessly,
    the valid one from ``consumed_valid_samples`` (the sampler derives the epoch from it).
    ``groups``: this rank's process groups (``tp`` and ``pp`` say whether it reads, ``dp`` its shard).
    ``train_iters``: see :func:`megalm.data.builder.get_train_valid_test_num_samples`.
    ``train_shares``: micro-batches per data-parallel rank of each global batch
    (``--straggler-rebalance-interval``; see :mod:`megalm.training.rebalance`).
    """
    reads = rank_reads_data(groups, every_stage=cfg.data.reset_attention_mask or positions_on_every_stage(cfg))
    num_samples = get_train_valid_test_num_samples(cfg, train_iters)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg, tokenizer, reads, num_samples)
    splits = _share_split_flags([ds is not None for ds in (train_ds, valid_ds, test_ds)])
    if not reads:
        return DataIterators(None, None, None, splits)
    dp_rank, dp_size = data_parallel_rank_and_size(groups)
    mbs, workers, kind = cfg.training.micro_batch_size, cfg.data.num_workers, cfg.data.dataloader_type

    def loader(ds, consumed, shares=None):
        return build_pretraining_data_loader(
            ds, consumed, mbs, dp_rank, dp_size, workers, kind, cfg.training.seed, cfg.data.data_sharding, shares
        )

    def iterate(dl, cyclic):
        return None if dl is None else iter(cyclic_iter(dl)) if cyclic else iter(dl)

    cyclic = kind == "cyclic"
    train = loader(train_ds, consumed_train_samples, train_shares)
    # single: the valid set is cycled, so a count beyond its size wraps around.
    wrapped_valid = consumed_valid_samples if cyclic or valid_ds is None else consumed_valid_samples % len(valid_ds)
    valid = loader(valid_ds, wrapped_valid)
    test = loader(test_ds, 0)
    iterators = (iterate(train, cyclic), iterate(valid, True), iterate(test, cyclic))
    return DataIterators(*iterators, splits, loaders=(train, valid, test))

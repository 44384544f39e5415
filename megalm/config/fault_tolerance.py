"""Checks of the torchft flags (``--ft-replica-group-id`` and the others, :mod:`megalm.config.parallel`)
against the batch and the features a replica group cannot combine with them yet
(:mod:`megalm.resilience.torchft_replicas` runs them)."""

from __future__ import annotations

import os

from megalm.config.fields import check


def ft_enabled(p) -> bool:
    """Whether this run is a torchft replica group."""
    return p.ft_replica_group_id is not None


def validate_fault_tolerance(cfg) -> None:
    """The flags themselves, before the layout is known (the batch split: :func:`validate_ft_batch`)."""
    p, t, d = cfg.parallel, cfg.training, cfg.data
    if not ft_enabled(p):
        check(
            p.ft_num_replica_groups == 0 and p.ft_lighthouse is None,
            "--ft-num-replica-groups / --ft-lighthouse need --ft-replica-group-id (this group's id)",
        )
        return
    groups, gid, least = p.ft_num_replica_groups, p.ft_replica_group_id, p.ft_min_replicas
    check(groups >= 1, f"--ft-replica-group-id needs --ft-num-replica-groups >= 1 (the most groups), got {groups}")
    check(0 <= gid < groups, f"--ft-replica-group-id {gid} is outside [0, --ft-num-replica-groups {groups})")
    check(1 <= least <= groups, f"--ft-min-replicas must be in [1, --ft-num-replica-groups {groups}], got {least}")
    check(p.ft_timeout_seconds > 0, f"--ft-timeout-seconds must be positive, got {p.ft_timeout_seconds:g}")
    check(
        p.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
        "--ft-replica-group-id needs the lighthouse's address: --ft-lighthouse http://HOST:PORT "
        "(or TORCHFT_LIGHTHOUSE)",
    )
    check(
        t.global_batch_size is not None,
        "--ft-replica-group-id needs --global-batch-size (the batch of all replica groups together)",
    )
    check(
        p.grad_compression != "int8" or groups <= 127,
        f"--grad-compression int8 across {groups} replica groups: each group's codes get 127 // groups levels, "
        "at most 127 groups",
    )
    for refused, what in (
        (t.straggler_rebalance_interval, "--straggler-rebalance-interval"),
        (
            p.local_sgd_overlap_steps,
            "--local-sgd-overlap-steps (an outer average in flight across a quorum change; the sync is blocking)",
        ),
        (
            p.outer_grad_int8_chunk,
            "--outer-grad-int8-chunk (torchft's fault-tolerant collectives have no all-gather)",
        ),
        (
            p.grad_compression not in ("none", "int8"),
            f"--grad-compression {p.grad_compression} (across replica groups only int8 is built: torchft's "
            "fault-tolerant collective is an all-reduce, and int8 codes with a shared scale add up in it)",
        ),
        (d.dataloader_type != "single", f"--dataloader-type {d.dataloader_type}"),
        (
            p.data_parallel_sharding_strategy == "optim_grads_params",
            "--data-parallel-sharding-strategy optim_grads_params (ZeRO-3: the state a recovering group receives is "
            "read from whole parameters)",
        ),
    ):
        check(not refused, f"torchft replica groups (--ft-replica-group-id) do not work with {what} yet")


def validate_ft_batch(p, t, schedule=None) -> None:
    """Every quorum of ``--ft-min-replicas`` .. ``--ft-num-replica-groups`` groups splits every global
    batch of the run (``--global-batch-size``, each batch of ``--rampup-batch-size`` and of
    ``schedule``: ``--step-batch-size-schedule``'s (threshold, batch) pairs) into whole, equal
    micro-batch shares (needs the data-parallel size)."""
    if not ft_enabled(p) or p.data_parallel_size is None:
        return
    per_group = t.micro_batch_size * p.data_parallel_size
    if (p.virtual_pipeline_model_parallel_size or 1) > 1:  # the interleaved schedule: a multiple of PP each
        per_group *= p.pipeline_model_parallel_size
    if t.rampup_batch_size:  # every batch of the ramp: start + k increment, k = 0, 1, ...
        start, increment, _ = (int(x) for x in t.rampup_batch_size)
        for n in range(p.ft_min_replicas, p.ft_num_replica_groups + 1):
            check(
                start % (per_group * n) == 0 and increment % (per_group * n) == 0,
                f"--rampup-batch-size {' '.join(map(str, t.rampup_batch_size))}: with torchft replica groups the "
                f"start and the increment must be multiples of --micro-batch-size {t.micro_batch_size} x data-parallel "
                f"size {p.data_parallel_size} x {n}{_pp(p)} (every batch of the ramp split evenly over every "
                f"quorum size from --ft-min-replicas {p.ft_min_replicas} to --ft-num-replica-groups "
                f"{p.ft_num_replica_groups})",
            )
    for _, batch in schedule or ():
        for n in range(p.ft_min_replicas, p.ft_num_replica_groups + 1):
            check(
                batch % (per_group * n) == 0,
                f"--step-batch-size-schedule: its global batch {batch} cannot be split evenly over a quorum of {n} "
                f"torchft replica groups: every batch must be a multiple of --micro-batch-size {t.micro_batch_size} x "
                f"data-parallel size {p.data_parallel_size} x {n}{_pp(p)} for every quorum size from --ft-min-replicas "
                f"{p.ft_min_replicas} to --ft-num-replica-groups {p.ft_num_replica_groups}",
            )
    for n in range(p.ft_min_replicas, p.ft_num_replica_groups + 1):
        check(
            t.global_batch_size % (per_group * n) == 0,
            f"--global-batch-size {t.global_batch_size} cannot be split evenly over a quorum of {n} replica groups: "
            f"it must be a multiple of --micro-batch-size {t.micro_batch_size} x data-parallel size "
            f"{p.data_parallel_size} x {n}{_pp(p)} for every quorum size from --ft-min-replicas {p.ft_min_replicas} to "
            f"--ft-num-replica-groups {p.ft_num_replica_groups}",
        )


def _pp(p) -> str:
    """The interleaved schedule's factor in the batch-split messages ('' without it)."""
    if (p.virtual_pipeline_model_parallel_size or 1) > 1:
        return f" x pipeline size {p.pipeline_model_parallel_size} (the interleaved schedule)"
    return ""

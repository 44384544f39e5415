"""Building a rank's model: one chunk per virtual pipeline stage, cast and moved to the device,
then wrapped in :class:`megalm.distributed.data_parallel.DistributedDataParallel`.

No communication here beyond what the model constructors and DDP's constructor do (DDP builds its
gradient buffers; its forward and backward communicate as its own docstring says).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Sequence

import torch

from megalm.config import MegalmConfig
from megalm.device import get_device
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.meta_init import MetaDeviceMode
from megalm.tensor_parallel.random import RNGStatesTracker


def build_model_chunks(
    cfg: MegalmConfig, model_provider: Callable, groups: ProcessGroups, rng_tracker: RNGStatesTracker
) -> List[torch.nn.Module]:
    """One model chunk per virtual pipeline stage of this rank, cast and moved to the device; every
    chunk is given the rank's ``rng_tracker`` (one tracker per rank, as one model has).

    Chunk ``v`` of pipeline rank ``r`` (of ``P``, ``V`` chunks each) is virtual stage ``v P + r``: it
    embeds the tokens when it is the first of all (``r = 0, v = 0``) and computes the loss when it
    is the last (``r = P - 1, v = V - 1``); the chunk index is passed, no pipeline rank is set.

    With ``--init-model-with-meta-device`` the chunks are built on the meta device and their parameters
    keep no storage until :func:`wrap_data_parallel` (DDP's buffers) gives it to them
    (:mod:`megalm.tensor_parallel.meta_init`)."""
    from megalm.models.layer_split import layers_for_stage
    from megalm.transformer.moe import share_moe_state

    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    pp_rank, pp = group_rank(groups.pp), group_size(groups.pp)
    meta = MetaDeviceMode() if cfg.parallel.init_model_with_meta_device else contextlib.nullcontext()
    chunks = []
    with meta:
        for v in range(vpp):
            model = model_provider(
                cfg,
                pre_process=pp_rank == 0 and v == 0,
                post_process=pp_rank == pp - 1 and v == vpp - 1,
                layer_numbers=layers_for_stage(cfg, pp_rank, v),
                process_groups=groups,
                rng_tracker=rng_tracker,
            )
            chunks.append(model)
    share_moe_state(chunks)  # one MoE metrics/aux-loss state per rank, as for one model
    dtype = torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16 else torch.float32
    device = get_device()
    if isinstance(meta, MetaDeviceMode):  # parameters stay on meta (DDP's buffers fill them), buffers are made
        meta.materialize_buffers(chunks)
        return [m.to(dtype=dtype) for m in chunks]
    return [m.to(device=device, dtype=dtype) for m in chunks]


def wrap_data_parallel(
    cfg: MegalmConfig, chunks: Sequence[torch.nn.Module], groups: ProcessGroups, comm_stats=None
) -> List[torch.nn.Module]:
    """Each chunk in a :class:`megalm.distributed.DistributedDataParallel` over ``groups``, its collectives
    counted in ``comm_stats`` (a :class:`megalm.distributed.comm.CommStats`; None: not counted)."""
    from megalm.distributed.data_parallel import DistributedDataParallel

    # fp16 finds non-finite gradients through its loss scaler; the per-bucket check serves the NaN stop
    check = cfg.training.check_for_nan_in_loss_and_grad and not cfg.training.fp16
    return [
        DistributedDataParallel(
            chunk, cfg.parallel, process_groups=groups, check_for_nan_in_grad=check, comm_stats=comm_stats
        )
        for chunk in chunks
    ]


def count_parameters(chunks: Sequence[torch.nn.Module]) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())

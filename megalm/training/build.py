"""Building a rank's model: one chunk per virtual pipeline stage, cast and moved to the device,
then wrapped in :class:`megalm.distributed.data_parallel.DistributedDataParallel`.

No communication here beyond what the model constructors and DDP's constructor do (DDP builds its
gradient buffers; its forward and backward communicate as its own docstring says).
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from megalm import parallel_state
from megalm.config import MegalmConfig
from megalm.device import get_device


def build_model_chunks(cfg: MegalmConfig, model_provider: Callable) -> List[torch.nn.Module]:
    """One model chunk per virtual pipeline stage of this rank, cast and moved to the device."""
    from megalm.models.layer_split import layers_for_stage
    from megalm.transformer.moe import share_moe_state

    vpp = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for v in range(vpp):
        if cfg.parallel.virtual_pipeline_model_parallel_size:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        model = model_provider(
            cfg,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            layer_numbers=layers_for_stage(cfg, pp_rank, v),
        )
        chunks.append(model)
    if cfg.parallel.virtual_pipeline_model_parallel_size:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    share_moe_state(chunks)  # one MoE metrics/aux-loss state per rank, as for one model
    dtype = torch.bfloat16 if cfg.training.bf16 else torch.float16 if cfg.training.fp16 else torch.float32
    device = get_device()
    return [m.to(device=device, dtype=dtype) for m in chunks]


def wrap_data_parallel(cfg: MegalmConfig, chunks: Sequence[torch.nn.Module]) -> List[torch.nn.Module]:
    from megalm.distributed.data_parallel import DistributedDataParallel

    # fp16 finds non-finite gradients through its loss scaler; the per-bucket check serves the NaN stop
    check = cfg.training.check_for_nan_in_loss_and_grad and not cfg.training.fp16
    return [DistributedDataParallel(chunk, cfg.parallel, check_for_nan_in_grad=check) for chunk in chunks]


def count_parameters(chunks: Sequence[torch.nn.Module]) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())

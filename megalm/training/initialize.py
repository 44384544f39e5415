"""Start-up: process groups, layout, seeds.  Called once by :func:`megalm.training.pretrain`."""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.config import MegalmConfig
from megalm.device import initialize_distributed
from megalm.tensor_parallel.random import RNGStatesTracker, model_parallel_manual_seed


def initialize_megalm(cfg: MegalmConfig) -> RNGStatesTracker:
    """Initialize torch.distributed (from torchrun's env) and the parallel layout, then seed; returns
    the seeded RNG tracker the model takes (``rng_tracker=``)."""
    if cfg.logging.logging_level is not None:
        logging.getLogger("megalm").setLevel(cfg.logging.logging_level)
    if cfg.training.deterministic_mode:
        use_deterministic_algorithms()
    if cfg.model.disable_bf16_reduced_precision_matmul:  # Megatron's flag; CUDA only (CPU GEMMs have no such mode)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    initialize_distributed(timeout=timeout)
    p = cfg.parallel
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size or 1,
            timeout=timeout,
            num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        )
    return set_random_seed(cfg.training.seed, parallel_state.get_process_groups())


def use_deterministic_algorithms() -> None:
    """``--deterministic-mode``: every op must use a deterministic kernel (an op without one raises);
    cuBLAS needs a fixed workspace for that (set before the first CUDA matmul)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def set_random_seed(seed: int, groups) -> RNGStatesTracker:
    """Seed python/numpy/torch (offset per pipeline stage, as Megatron); returns a new TP RNG tracker
    seeded the same way (:func:`megalm.tensor_parallel.random.model_parallel_manual_seed`)."""
    stage_seed = seed + 100 * parallel_state.group_rank(groups.pp)
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    return model_parallel_manual_seed(stage_seed, groups)


def world_size_from_env() -> int:
    import os

    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))

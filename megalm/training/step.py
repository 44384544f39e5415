"""One training iteration and one evaluation pass, as Megatron-LM's ``train_step`` and ``evaluate``.

``train_step``: zero the gradient buffers, run the schedule over the microbatches (backward of
all but the last microbatch without communication), finalize gradients (data-parallel bucket
reduction, sequence-parallel and tied-embedding reductions), optimizer step (loss scale check,
clipping); each phase under its Megatron timer (:mod:`megalm.timers`).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.config import MegalmConfig
from megalm.device import get_device
from megalm.pipeline_parallel import get_forward_backward_func
from megalm.timers import NULL_TIMERS, timed_iterator


# --- one iteration -----------------------------------------------------------------------

def train_step(cfg: MegalmConfig, forward_step_func: Callable, data_iterator, model: List[torch.nn.Module],
               optimizer, scheduler, num_microbatches: int, timers=NULL_TIMERS) -> Dict[str, object]:
    from megalm.distributed.finalize_model_grads import finalize_model_grads
    from megalm.transformer.moe import begin_training_step as begin_moe_step

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    begin_moe_step(model, optimizer.get_loss_scale(), num_microbatches)  # aux-loss backward scale (MoE)
    forward_backward = get_forward_backward_func()
    with timers("forward-backward"):
        reported = forward_backward(forward_step_func=forward_step_func,
                                    data_iterator=timed_iterator(data_iterator, timers("batch-generator")),
                                    model=model, num_microbatches=num_microbatches, forward_only=False,
                                    loss_scale=optimizer.scale_loss, seq_length=cfg.model.seq_length,
                                    micro_batch_size=cfg.training.micro_batch_size, config=cfg, timers=timers)
    finalize_model_grads(model, timers=timers)
    with timers("optimizer"):
        update_successful, grad_norm, num_zeros = optimizer.step(timers)
    return {"reported": average_reported(reported), "update_successful": update_successful,
            "grad_norm": grad_norm}


def average_reported(reported: List[Dict]) -> Dict[str, float]:
    """Mean over microbatches, then over data-parallel ranks (one all-reduce); with pipeline
    parallelism only the last stage has values and broadcasts them to every stage (collective
    over the pipeline group: every rank calls this)."""
    from megalm.pipeline_parallel.reporting import broadcast_from_last_stage

    return broadcast_from_last_stage(_average_over_microbatches_and_dp(reported))


def _average_over_microbatches_and_dp(reported: List[Dict]) -> Dict[str, float]:
    if not reported:
        return {}
    keys = sorted(reported[0])
    local = torch.tensor([[float(r[k]) for k in keys] for r in reported], dtype=torch.float64).mean(0)
    if parallel_state.get_data_parallel_world_size() > 1:
        local = local.to(get_device())
        dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
        local = local.cpu() / parallel_state.get_data_parallel_world_size()
    return {k: float(v) for k, v in zip(keys, local)}


def evaluate(cfg: MegalmConfig, forward_step_func: Callable, data_iterator, model: List[torch.nn.Module],
             eval_iters: int, num_microbatches: int) -> Dict[str, float]:
    """Forward-only over ``eval_iters`` global batches; mean of each reported value."""
    for chunk in model:
        chunk.eval()
    forward_backward = get_forward_backward_func()
    totals: Dict[str, float] = {}
    with torch.no_grad():
        for _ in range(eval_iters):
            reported = forward_backward(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                        model=model, num_microbatches=num_microbatches, forward_only=True,
                                        seq_length=cfg.model.seq_length,
                                        micro_batch_size=cfg.training.micro_batch_size, config=cfg)
            for k, v in average_reported(reported).items():
                totals[k] = totals.get(k, 0.0) + v / eval_iters
    for chunk in model:
        chunk.train()
    return totals

#!/usr/bin/env python
"""Pretrain a GPT model (Megatron-LM's pretrain_gpt.py, the megalm way).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \\
        --micro-batch-size 4 --global-batch-size 16 --train-iters 200 --lr 3e-4 \\
        --data-path my-corpus_text_document --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --save ckpt --save-interval 100

The four familiar parts: model provider, batch getter, loss function, forward step.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megalm.config import ConfigError, MegalmConfig, build_parser
from megalm.context_parallel.loss import context_parallel_loss
from megalm.device import shutdown_distributed
from megalm.distributed.finalize_model_grads import unwrap_model
from megalm.errors import MegalmError, TrainingStopped
from megalm.log import setup_logging
from megalm.models import GPTModel
from megalm.parallel_state import ProcessGroups
from megalm.tensor_parallel.random import RNGStatesTracker
from megalm.training import get_batch, pretrain
from megalm.transformer.moe import pop_moe_metrics


def model_provider(
    cfg: MegalmConfig,
    pre_process: bool = True,
    post_process: bool = True,
    layer_numbers=None,
    *,
    process_groups: ProcessGroups,
    rng_tracker: RNGStatesTracker,
) -> GPTModel:
    """The GPT model chunk for this pipeline stage (its global layer numbers), communicating over
    ``process_groups`` (the Trainer's bundle; Megatron-core's ``pg_collection``) and drawing dropout
    masks from ``rng_tracker`` (the rank's, seeded by the Trainer)."""
    return GPTModel(
        cfg,
        pre_process=pre_process,
        post_process=post_process,
        layer_numbers=layer_numbers,
        process_groups=process_groups,
        rng_tracker=rng_tracker,
    )


def loss_func(loss_mask: torch.Tensor, model: torch.nn.Module, output_tensor: torch.Tensor):
    """Megatron's three values: the sum of the per-token losses over unmasked tokens of this
    microbatch, their number, and the reported ``{"lm loss": [sum, count]}`` (the schedule
    divides by the count per microbatch, or, with --calculate-per-token-loss, the trainer by the
    global count).  MoE models also report their routers' auxiliary losses and load statistics
    (their gradients are already attached to the backward pass by the routers).  Under context
    parallelism the count and reported values are the whole sequence's and the loss is scaled
    for the gradient average over data x context ranks (:mod:`megalm.context_parallel.loss`)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    groups = getattr(unwrap_model(model), "process_groups", None)  # None: a model of one process
    cp_group = None if groups is None else groups.cp
    loss, num_tokens, reported = context_parallel_loss(torch.sum(losses * mask), mask.sum().detach(), cp_group)
    mtp = getattr(unwrap_model(model), "mtp_metrics", dict)()  # mtp_<k> loss (--mtp-num-layers)
    return loss, num_tokens, {"lm loss": reported, **pop_moe_metrics(model), **mtp}


def forward_step(data_iterator, model):
    """One microbatch: tokens in, per-token losses out (on the last stage)."""
    gpt = unwrap_model(model)  # its config sizes the batch; its process groups carry it
    batch = get_batch(data_iterator, gpt.cfg, gpt.process_groups)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"],
        packed_seq_params=batch["packed_seq_params"],
    )
    return output, partial(loss_func, batch["loss_mask"], model)


def _rank_and_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def main(
    argv: Optional[Sequence[str]] = None,
    forward_step_func: Callable = forward_step,
    model_provider_func: Callable = model_provider,
) -> None:
    """Train; a :class:`megalm.errors.MegalmError` becomes ``SystemExit("error: <message>")``
    (exit code 1, the message on stderr), a stop on purpose (``TrainingStopped``) its exit code.
    ``model_provider_func`` (default :func:`model_provider`) lets tests build a modified model."""
    rank, world = _rank_and_world()
    setup_logging(rank, world)
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if "--auto-layout" in argv:  # the planner's first choice for this world (megalm/planner/auto.py)
            from megalm.planner.auto import auto_layout_argv

            argv = auto_layout_argv(argv, world, log=print if rank == 0 else (lambda *_: None))
        pretrain(model_provider_func, forward_step_func, argv=argv)
    except TrainingStopped as e:
        if e.exit_code:
            raise SystemExit(e.exit_code) from None
    except ConfigError as e:  # a bad flag: argparse's usage line and status 2, as Megatron
        build_parser().print_usage(sys.stderr)
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {e}\n")
        raise SystemExit(2) from None
    except MegalmError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
    shutdown_distributed()  # barrier + destroy (NCCL warns at exit otherwise; gloo may abort in teardown)

"""Megatron-LM flags that megalm accepts so Megatron's launch scripts run as written.

Each flag here changes nothing in megalm, for the reason given in :data:`NO_EFFECT`; when any
is given, one warning line lists them.  Flags whose value megalm cannot honour are refused by
:func:`refusal` (e.g. ``--distributed-backend nccl`` without CUDA).  Flags that change the model or
the training are never accepted here: they are implemented in their own section or refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalm.config.fields import Section, check
from megalm.config.fields import flag_field as _f

# Flag -> why it has no effect in megalm (the text of the warning).
NO_EFFECT = {
    "--use-mcore-models": "megalm's GPT is built like megatron-core's (same parameter names); there is no legacy model",
    "--no-gradient-accumulation-fusion": "weight gradients accumulate through autograd into DDP's grad buffers; "
    "there is no fused wgrad kernel to turn off",
    "--attention-softmax-in-fp32": "megalm's attention softmax always computes in fp32",
    "--no-create-attention-mask-in-dataloader": "the data loader never builds an attention mask (causal attention "
    "needs none; --reset-attention-mask's document mask is built in get_batch)",
    "--no-mmap-bin-files": "megalm always memory-maps .bin files",
    "--manual-gc": "Python's automatic garbage collection stays on",
    "--manual-gc-interval": "Python's automatic garbage collection stays on",
    "--empty-unused-memory-level": "megalm never empties the CUDA caching allocator between steps",
    "--dist-ckpt-strictness": "megalm loads checkpoints strictly: a missing or unexpected key is an error",
    "--use-persistent-ckpt-worker": "--async-save writes from a background thread of each training process",
    "--distributed-backend": "megalm picks the backend itself (nccl with CUDA, gloo without) and checked it matches",
    "--tiktoken-pattern": "only Megatron's TikTokenizer reads it, and megalm has no TikTokenizer",
    "--export-force-local-attention": "a ModelOpt export switch (local attention instead of Transformer Engine's); "
    "megalm's attention cores are its own, and windows and sinks run in each of them",
    "--use-nccl-ub": "NCCL user-buffer registration (NCCL only; megalm's buffers are plain PyTorch allocations)",
    "--fsdp-double-buffer": "Megatron-FSDP's double-buffered all-gather/reduce-scatter buffers for NCCL user "
    "buffers (NCCL only); megalm's ZeRO-3 gathers into its own per-bucket buffers",
    "--fsdp-manual-registration": "manual NCCL user-buffer registration with --use-nccl-ub (NCCL only)",
    "--moe-permute-fusion": "megalm permutes tokens to experts with PyTorch index ops (the same order and results); "
    "Transformer Engine's fused permute kernels are CUDA-only",
    "--moe-flex-dispatcher-backend": "--moe-token-dispatcher-type flex runs megalm's alltoall dispatcher; the "
    "DeepEP / HybridEP backends are CUDA kernels",
    "--enable-experimental": "megalm has no experimental-feature gate",
    "--use-megatron-fsdp": "megalm's own sharded data parallelism is chosen by --data-parallel-sharding-strategy "
    "alone (no_shard by default, as in Megatron-LM)",
}

# Megatron-LM flags (and combinations) megalm refuses, with why: the documented unsupported list.
UNSUPPORTED = {
    "--fp8-format": "fp8 needs Transformer Engine's layers (--transformer-impl transformer_engine on a GPU)",
    "--fp8-param-gather": "fp8 parameter all-gather is not built (fp8 runs inside Transformer Engine's layers only)",
    "--ckpt-format": "formats other than torch_dist and fsdp_dtensor (torch, zarr, torch_dcp): megalm reads and writes "
    "those two; convert Megatron-LM's torch_dist and legacy torch checkpoints with tools/checkpoint/convert.py",
    "--profile": "without --use-pytorch-profiler on a machine without CUDA (nsys profiles CUDA only)",
}


@dataclass
class MegatronCompatConfig(Section):
    """Megatron-LM flags accepted for its launch scripts; they change nothing in megalm (one warning lists them)."""

    use_mcore_models: bool = _f(False, "No effect: " + NO_EFFECT["--use-mcore-models"] + ".")
    no_gradient_accumulation_fusion: bool = _f(False, "No effect: " + NO_EFFECT["--no-gradient-accumulation-fusion"])
    attention_softmax_in_fp32: bool = _f(False, "No effect: " + NO_EFFECT["--attention-softmax-in-fp32"] + ".")
    no_create_attention_mask_in_dataloader: bool = _f(
        False, "No effect: " + NO_EFFECT["--no-create-attention-mask-in-dataloader"] + "."
    )
    no_mmap_bin_files: bool = _f(False, "No effect: " + NO_EFFECT["--no-mmap-bin-files"] + ".")
    manual_gc: bool = _f(False, "No effect: " + NO_EFFECT["--manual-gc"] + ".")
    manual_gc_interval: Optional[int] = _f(None, "No effect: " + NO_EFFECT["--manual-gc-interval"] + ".")
    empty_unused_memory_level: Optional[int] = _f(
        None, "No effect: " + NO_EFFECT["--empty-unused-memory-level"] + ".", choices=[0, 1, 2]
    )
    dist_ckpt_strictness: Optional[str] = _f(None, "No effect: " + NO_EFFECT["--dist-ckpt-strictness"] + ".")
    use_persistent_ckpt_worker: bool = _f(False, "No effect: " + NO_EFFECT["--use-persistent-ckpt-worker"] + ".")
    distributed_backend: Optional[str] = _f(
        None, "Checked against the backend megalm picks (nccl with CUDA, gloo without).", choices=["nccl", "gloo"]
    )
    tiktoken_pattern: Optional[str] = _f(None, "No effect: " + NO_EFFECT["--tiktoken-pattern"] + ".")
    use_megatron_fsdp: bool = _f(False, "No effect: " + NO_EFFECT["--use-megatron-fsdp"] + ".")
    nccl_ub: bool = _f(False, "No effect: " + NO_EFFECT["--use-nccl-ub"] + ".", flag="--use-nccl-ub")
    fsdp_double_buffer: bool = _f(False, "No effect: " + NO_EFFECT["--fsdp-double-buffer"] + ".")
    fsdp_manual_registration: bool = _f(False, "No effect: " + NO_EFFECT["--fsdp-manual-registration"] + ".")
    export_force_local_attention: bool = _f(False, "No effect: " + NO_EFFECT["--export-force-local-attention"] + ".")
    moe_permute_fusion: bool = _f(False, "No effect: " + NO_EFFECT["--moe-permute-fusion"] + ".")
    moe_flex_dispatcher_backend: Optional[str] = _f(
        None, "No effect: " + NO_EFFECT["--moe-flex-dispatcher-backend"] + ".", choices=["deepep", "hybridep"]
    )
    enable_experimental: bool = _f(False, "No effect: " + NO_EFFECT["--enable-experimental"] + ".")
    fp8_param_gather: bool = _f(False, "Refused: " + UNSUPPORTED["--fp8-param-gather"] + ".")

    def validate(self) -> None:
        """Refuses the flags whose value megalm cannot honour (see :func:`refusal`)."""
        from megalm.device import get_backend

        why = refusal(self, get_backend())
        check(why is None, why or "")


def given_no_effect_flags(c: MegatronCompatConfig) -> list:
    """The flags of :data:`NO_EFFECT` that were given (set away from their defaults)."""
    values = {
        "--use-mcore-models": c.use_mcore_models,
        "--no-gradient-accumulation-fusion": c.no_gradient_accumulation_fusion,
        "--attention-softmax-in-fp32": c.attention_softmax_in_fp32,
        "--no-create-attention-mask-in-dataloader": c.no_create_attention_mask_in_dataloader,
        "--no-mmap-bin-files": c.no_mmap_bin_files,
        "--manual-gc": c.manual_gc,
        "--manual-gc-interval": c.manual_gc_interval is not None,
        "--empty-unused-memory-level": c.empty_unused_memory_level is not None,
        "--dist-ckpt-strictness": c.dist_ckpt_strictness is not None,
        "--use-persistent-ckpt-worker": c.use_persistent_ckpt_worker,
        "--distributed-backend": c.distributed_backend is not None,
        "--tiktoken-pattern": c.tiktoken_pattern is not None,
        "--use-megatron-fsdp": c.use_megatron_fsdp,
        "--export-force-local-attention": c.export_force_local_attention,
        "--use-nccl-ub": c.nccl_ub,
        "--fsdp-double-buffer": c.fsdp_double_buffer,
        "--fsdp-manual-registration": c.fsdp_manual_registration,
        "--moe-permute-fusion": c.moe_permute_fusion,
        "--moe-flex-dispatcher-backend": c.moe_flex_dispatcher_backend is not None,
        "--enable-experimental": c.enable_experimental,
    }
    return [flag for flag, given in values.items() if given]


def refusal(c: MegatronCompatConfig, backend: str) -> Optional[str]:
    """Why these flags cannot be honoured (None when they can); ``backend``: the one megalm picks."""
    for flag, given in (("--fp8-param-gather", c.fp8_param_gather),):
        if given:
            return f"{flag} is not supported by megalm: {UNSUPPORTED[flag]}"
    if c.distributed_backend is not None and c.distributed_backend != backend:
        return (
            f"--distributed-backend {c.distributed_backend} does not match the backend megalm uses on this machine "
            f"({backend}: nccl when CUDA is visible, gloo otherwise); drop the flag"
        )
    return None

"""Megatron-FSDP's gradient precision flags mapped onto megalm's gradient buffers (one dtype for
accumulation, reduction and the optimizer's main gradients: fp32, or the parameters' bf16/fp16)."""

from __future__ import annotations

from megalm.config.fields import check
from megalm.config.parallel import ParallelConfig
from megalm.config.training import TrainingConfig


def validate_fsdp_grad_dtypes(p: ParallelConfig, t: TrainingConfig) -> None:
    """--megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype onto the gradient buffers' dtype
    (fp32, or the parameters' bf16/fp16): megalm accumulates and reduces in one buffer."""
    main, comm = p.megatron_fsdp_main_grads_dtype, p.megatron_fsdp_grad_comm_dtype
    check(
        main == "auto" or comm == "auto" or main == comm,
        f"--megatron-fsdp-main-grads-dtype {main} with --megatron-fsdp-grad-comm-dtype {comm}: megalm reduces the "
        "gradients in their buffers, so the two dtypes must be the same (or one auto)",
    )
    want = main if main != "auto" else comm
    if want == "auto":
        return
    params = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    check(
        want in ("fp32", params),
        f"gradient dtype {want} (--megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype) needs "
        f"--{want} parameters; these are {params}",
    )
    p.accumulate_allreduce_grads_in_fp32 = want == "fp32"

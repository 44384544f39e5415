"""Compare a megalm checkpoint and a Hugging Face directory by their logits (needs ``transformers``).

Both models run in fp32 in this process on a few random token sequences: megalm's
:class:`~megalm.models.GPTModel` (TP 1, filled from the checkpoint's full tensors) and
``AutoModelForCausalLM`` loaded from the directory.  When the HF weights were written in a
lower precision, megalm's weights are rounded the same way first, so the comparison checks
the mapping, not the rounding.  Reported: the largest absolute logit difference and the
KL divergence ``KL(p_megalm || p_hf)`` per position (mean and max).
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch

from megalm.config import MegalmConfig, set_vocab_size
from megalm.conversion.base import VOCAB_ROWS
from megalm.conversion.errors import ConversionError
from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader


def megalm_model_from_tensors(cfg: MegalmConfig, tensors: Dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """A single-process (TP 1, EP 1) GPTModel holding ``tensors`` (full, as a checkpoint stores them), in eval mode."""
    from megalm.fusions import EAGER
    from megalm.models import GPTModel
    from megalm.parallel_state import ProcessGroups

    cfg = copy.deepcopy(cfg)
    p = cfg.parallel
    p.tensor_model_parallel_size = p.pipeline_model_parallel_size = p.expert_model_parallel_size = 1
    p.sequence_parallel = False
    p.num_layers_per_virtual_pipeline_stage = p.num_virtual_stages_per_pipeline_rank = None
    p.virtual_pipeline_model_parallel_size = None
    set_vocab_size(cfg, cfg.model.vocab_size)
    # the plain PyTorch reference (and any sequence length), one process
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=ProcessGroups.single())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in tensors:
                raise ConversionError(f"no tensor for parameter {name}")
            value = tensors[name]
            if name in VOCAB_ROWS:
                param.zero_()
                param[: value.shape[0]].copy_(value)
            else:
                param.copy_(value.reshape(param.shape))
        for name, buffer in model.named_buffers():  # e.g. a router's expert_bias, when the tensors hold it
            if name in tensors:
                buffer.copy_(tensors[name])
    return model.to(dtype).eval()


def _load_hf(hf_dir: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ConversionError("--verify needs transformers (pip install transformers)") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    except TypeError:  # transformers 4.x names the argument torch_dtype
        model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, local_files_only=True)
    return model.eval()


@torch.no_grad()
def compare_logits(
    megalm_dir: str,
    hf_dir: str,
    iteration: Optional[int] = None,
    num_sequences: int = 3,
    seq_length: Optional[int] = None,
    seed: int = 0,
    round_to: Optional[torch.dtype] = None,
) -> dict:
    """``{"max_abs_diff", "mean_kl", "max_kl", "tokens"}`` between the two models' logits."""
    reader = MegalmCheckpointReader(megalm_dir, iteration)
    tensors = reader.load(reader.model_names)
    if round_to is not None:
        tensors = {k: v.to(round_to) for k, v in tensors.items()}
    tensors = {k: v.float() for k, v in tensors.items()}
    m = reader.config.model
    megalm_model = megalm_model_from_tensors(reader.config, tensors)
    hf_model = _load_hf(hf_dir)
    s = min(seq_length or 32, m.max_position_embeddings, m.seq_length)
    tokens = torch.randint(0, m.vocab_size, (num_sequences, s), generator=torch.Generator().manual_seed(seed))
    ours = megalm_model(tokens)[..., : m.vocab_size].double()
    theirs = hf_model(input_ids=tokens).logits.double()
    if theirs.shape != ours.shape:
        raise ConversionError(f"logits shapes differ: megalm {tuple(ours.shape)}, transformers {tuple(theirs.shape)}")
    log_p, log_q = torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "max_abs_diff": float((ours - theirs).abs().max()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "tokens": int(tokens.numel()),
    }

"""Megatron-LM's Adam state (``torch_dist``, model space) -> megalm's optimizer checkpoint entries.

megatron-core saves the state of its plain optimizers, and of the distributed optimizer in its
``fully_sharded_model_space`` format, as ``optimizer.state.<state>.<model key>`` with the model key's
global shape (``exp_avg`` and ``exp_avg_sq``: Adam's moments; ``fp32_param``: the fp32 main weights of a
half-precision run): the same names, stacking and padding as the weights, so they map exactly like
the weights (:func:`megalm.conversion.megatron.to_megalm_names`).  megalm's checkpoint holds them as
``optimizer.<name>.exp_avg`` / ``exp_avg_sq`` / ``main_param`` and a one-element ``step``, and
``optimizer_common`` names the optimizer (``AdamW``: Megatron's Adam decays weights decoupled).

The distributed optimizer's ``fully_reshardable`` format saves the same model-space keys with
``param`` for ``fp32_param``; its ``dp_reshardable`` flat buffers (Megatron-LM's default) are turned
into model-space tensors first (:mod:`megalm.conversion.megatron_flat_optimizer`).  Adam's step count
(bias correction) comes from the optimizer's saved ``param_groups`` (the common state, or the
``dp_reshardable`` format's own entry) when they hold one, else from the iteration number (exact
without fp16 loss-scale skips).  ``fully_sharded_bucket_space`` and ``dp_zero_gather_scatter`` are not
read: only the weights are imported then, and a note says so.  No communication.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megalm.optimizer.optimizer import FORMAT

# Megatron state name -> megalm's optimizer state key.
STATE_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main_param"}


def saved_step(common: dict) -> Optional[int]:
    """Adam's step from ``common.pt``'s optimizer ``param_groups`` (``step``), when saved there."""
    optimizer = common.get("optimizer") if isinstance(common, dict) else None
    while isinstance(optimizer, dict) and "param_groups" not in optimizer and "optimizer" in optimizer:
        optimizer = optimizer["optimizer"]
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    steps = {int(g["step"]) for g in groups or () if isinstance(g, dict) and "step" in g}
    return steps.pop() if len(steps) == 1 else None


def iteration_of(directory_name: str) -> Optional[int]:
    found = re.fullmatch(r"iter_(\d+)", directory_name)
    return int(found.group(1)) if found else None


def optimizer_entries(
    states: Dict[str, Dict[str, torch.Tensor]],
    to_megalm: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]],
    params: List[str],
    step: Optional[int],
) -> Tuple[Optional[Dict[str, torch.Tensor]], Optional[dict], str]:
    """``(checkpoint entries, optimizer_common, note)``; entries None (with the note saying why) when the
    state cannot be imported.  ``states``: :meth:`TorchDistCheckpoint.optimizer_states`; ``to_megalm``:
    the weights' name mapping; ``params``: megalm's parameter names, each of which needs both moments."""
    if not {"exp_avg", "exp_avg_sq"} <= set(states):
        return None, None, "the optimizer state was not imported (weights only): it is not in model space"
    if step is None:
        return None, None, "the optimizer state was not imported (weights only): Adam's step count is unknown"
    entries = {}
    for state, tensors in states.items():
        mapped = to_megalm(tensors)
        missing = sorted(set(params) - set(mapped))
        if missing and state != "fp32_param":
            return None, None, f"the optimizer state was not imported (weights only): no {state} for {missing[:2]}"
        for name, t in mapped.items():
            if name in params:
                entries[f"optimizer.{name}.{STATE_KEYS[state]}"] = t.float()
    for name in params:
        entries[f"optimizer.{name}.step"] = torch.tensor([float(step)])
    common = {"format": FORMAT, "optimizer": "AdamW", "grad_scaler": None, "param_groups": []}
    kinds = "moments and fp32 main weights" if "fp32_param" in states else "moments"
    return entries, common, f"Adam's optimizer state imported ({kinds}, step {step}): resume with --load"

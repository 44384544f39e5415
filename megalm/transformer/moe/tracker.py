"""Per-micro-batch MoE metrics, from the routers to the loss function's reported dict.

Each MoE layer's router records, once per training forward (not when recomputed in backward),
detached values for its global layer number:

* ``load_balancing_loss``, ``z_loss``: without their coefficients, for the whole micro-batch
  of this data-parallel rank (summed over tensor-parallel slices);
* ``tokens_per_expert``: ``[E]`` top-k counts before capacity dropping.

The tracker belongs to the model's :class:`~megalm.transformer.moe.state.MoEState`.  The loss
function (``pretrain_gpt.loss_func``) calls ``pop_moe_metrics(model)`` right after the forward
pass of each micro-batch and adds the result to its reported dict; the trainer
averages reported values over micro-batches and data-parallel ranks and prints / writes every
key.  Reported keys:

* ``load_balancing_loss``, ``z_loss``: mean over MoE layers;
* ``expert_load_imbalance``: mean over MoE layers of max_i count_i / mean_i count_i (1 is
  perfectly balanced, E / k the worst);
* with ``--moe-per-layer-logging`` also ``<name>_layer_<L>`` for each loss and
  ``tokens_per_expert_layer_<L>_expert_<i>``.

With pipeline parallelism the last stage reports the layers it holds.  No communication.
"""

from __future__ import annotations

from typing import Dict, List

import torch


class MoEMetricsTracker:
    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._values: Dict[str, Dict[int, List[torch.Tensor]]] = {}
        self.per_layer = False

    def record(self, layer: int, name: str, value: torch.Tensor, per_layer: bool = False) -> None:
        self._values.setdefault(name, {}).setdefault(int(layer), []).append(value.detach())
        self.per_layer = self.per_layer or per_layer

    def __bool__(self) -> bool:
        return bool(self._values)

    def pop(self) -> Dict[str, torch.Tensor]:
        """Reported values of everything recorded since the last pop; then forget it."""
        values, per_layer = self._values, self.per_layer
        self.clear()
        out: Dict[str, torch.Tensor] = {}
        for name in sorted(values):
            layers = {layer: torch.stack(v).float().mean(0) for layer, v in sorted(values[name].items())}
            if name == "tokens_per_expert":
                ratios = [c.max() / c.mean().clamp(min=1e-9) for c in layers.values()]
                out["expert_load_imbalance"] = torch.stack(ratios).mean()
                if per_layer:
                    for layer, counts in layers.items():
                        for i, c in enumerate(counts):
                            out[f"tokens_per_expert_layer_{layer}_expert_{i}"] = c
                continue
            out[name] = torch.stack(list(layers.values())).mean()
            if per_layer:
                for layer, v in layers.items():
                    out[f"{name}_layer_{layer}"] = v
        return out

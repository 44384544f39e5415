"""The transformer layers of one model chunk, the final norm on the last stage, and
activation recomputation.

Layers are stored as ``layers = ModuleDict({str(global_index): layer})`` so parameter names
are global (``decoder.layers.5.mlp.linear_fc1.weight``) for every pipeline split.

Recomputation (``--recompute-granularity``), numerically identical to none:

* ``full`` + ``uniform``: the chunk's layers are cut into groups of ``recompute_num_layers``
  consecutive layers; only each group's input is kept and the group is recomputed in backward.
* ``full`` + ``block``: the first ``recompute_num_layers`` layers of this chunk are each
  recomputed; the others keep their activations.
* ``selective``: the modules of ``--recompute-modules`` (by default the attention core, the ``s x s``
  part) are recomputed: see :class:`~megalm.transformer.transformer_layer.TransformerLayer`.

Activation offloading (``--cpu-offloading``, :mod:`megalm.transformer.activation_offload`): the
saved tensors of the chunk's first ``--cpu-offloading-num-layers`` layers wait in host memory
between their forward and backward (training forwards with grad only; not with recompute).

With ``--fp8-format`` (Transformer Engine layers) the layers of every forward run inside TE's
``fp8_autocast`` (:mod:`megalm.transformer.fp8`): one region per model chunk, so every pipeline
stage is covered; the final norm and KV-cache generation stay outside.

No communication of its own (fp8: TE's amax reduction, see :mod:`megalm.transformer.fp8`);
the layers communicate over the groups of ``process_groups``.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
from torch import nn

from megalm.config.sections import ConfigError
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.parallel_state import ProcessGroups
from megalm.tensor_parallel.random import RNGStatesTracker, checkpoint
from megalm.transformer.activation_offload import ActivationOffload
from megalm.transformer.fp8 import fp8_autocast
from megalm.transformer.moe.state import MoEState
from megalm.transformer.norm import build_norm
from megalm.transformer.transformer_layer import TransformerLayer
from megalm.transformer.utils import recompute_modules


class TransformerBlock(nn.Module):
    def __init__(
        self,
        model_cfg,
        layer_numbers: Sequence[int],
        process_groups: ProcessGroups,
        post_process: bool = True,
        sequence_parallel: bool = False,
        plan: FusionPlan = EAGER,
        moe_state: Optional[MoEState] = None,
        cp_comm_type: str = "p2p",
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()
        m = model_cfg
        self.rng_tracker = RNGStatesTracker() if rng_tracker is None else rng_tracker  # every layer's
        self.recompute_granularity = m.recompute_granularity
        self.recompute_method = m.recompute_method
        self.recompute_num_layers = m.recompute_num_layers
        selective = "core_attn" in recompute_modules(m)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    m,
                    i,
                    process_groups,
                    sequence_parallel,
                    recompute_core_attention=selective,
                    plan=plan,
                    moe_state=moe_state,
                    cp_comm_type=cp_comm_type,
                    rng_tracker=self.rng_tracker,
                )
                for i in layer_numbers
            }
        )
        self.final_layernorm = (
            build_norm(
                m.normalization, m.hidden_size, m.norm_epsilon, sequence_parallel, plan.norm, m.apply_layernorm_1p
            )
            if post_process
            else None
        )
        self.input_tensor: Optional[torch.Tensor] = None
        self.activation_offload = ActivationOffload(m.cpu_offloading_num_layers) if m.cpu_offloading else None
        # A factory of fp8 regions; TE reduces amax over the stage's tensor x data x context ranks.
        self.fp8_autocast = fp8_autocast(m, process_groups.tp_dp_cp) if plan.fp8 is not None else None

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Hidden states received from the previous pipeline stage (used when not pre_process)."""
        self.input_tensor = input_tensor

    def _layer_list(self) -> List[TransformerLayer]:
        return list(self.layers.values())

    @staticmethod
    def _run_layers(layers: Sequence[TransformerLayer]):
        def run(hidden, rotary_cos, rotary_sin, attention_mask=None):
            for layer in layers:
                hidden = layer(hidden, rotary_cos, rotary_sin, attention_mask=attention_mask)
            return hidden

        return run

    def _forward_full_recompute(self, hidden, rotary_cos, rotary_sin, mask):
        layers, n = self._layer_list(), self.recompute_num_layers
        if self.recompute_method == "uniform":
            for start in range(0, len(layers), n):
                hidden = checkpoint(
                    self._run_layers(layers[start : start + n]),
                    hidden,
                    rotary_cos,
                    rotary_sin,
                    mask,
                    rng_tracker=self.rng_tracker,
                )
            return hidden
        if self.recompute_method == "block":
            for index, layer in enumerate(layers):
                if index < n:
                    hidden = checkpoint(
                        self._run_layers([layer]), hidden, rotary_cos, rotary_sin, mask, rng_tracker=self.rng_tracker
                    )
                else:
                    hidden = layer(hidden, rotary_cos, rotary_sin, attention_mask=mask)
            return hidden
        raise ConfigError(f"unknown --recompute-method {self.recompute_method!r}")

    def forward(
        self,
        hidden: torch.Tensor,
        rotary_cos: Optional[torch.Tensor] = None,
        rotary_sin: Optional[torch.Tensor] = None,
        inference_cache=None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``[s(/tp), b, h]`` in and out; the final norm is applied on the last stage.  ``attention_mask``:
        the document mask of ``--reset-attention-mask`` (boolean ``[b, 1, s, s]``), else causal.

        ``inference_cache`` (generation only, see :class:`megalm.inference.kv_cache.KVCache`):
        each layer appends its keys/values to ``inference_cache.layer(layer_number)``; no recompute.
        """
        if inference_cache is not None:
            for layer in self._layer_list():
                hidden = layer(hidden, rotary_cos, rotary_sin, kv_cache=inference_cache.layer(layer.layer_number))
        else:
            with self.fp8_autocast() if self.fp8_autocast is not None else contextlib.nullcontext():
                if self.recompute_granularity == "full" and self.training:
                    hidden = self._forward_full_recompute(hidden, rotary_cos, rotary_sin, attention_mask)
                elif self.activation_offload is not None and self.training and torch.is_grad_enabled():
                    hidden = self.activation_offload.run(
                        self._layer_list(), hidden, rotary_cos, rotary_sin, attention_mask
                    )
                else:
                    hidden = self._run_layers(self._layer_list())(hidden, rotary_cos, rotary_sin, attention_mask)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden

"""Run-time state the MoE layers of one model share: the metrics their routers record and the
backward factor of their auxiliary losses.

One :class:`MoEState` per model (``GPTModel.moe_state``; a standalone :class:`MoELayer` or
router makes its own), passed to every router at construction: nothing is module- or
class-level, so two models in one process (e.g. a reference and a parallel one in a test)
do not see each other's metrics or scales.

The trainer calls :meth:`begin_training_step` (through ``GPTModel.set_aux_loss_scale``)
before each step's forward/backward passes; the loss function pops the metrics
(``GPTModel.moe_metrics``) after each micro-batch's forward.  No communication.
"""

from __future__ import annotations

from typing import Dict

import torch

from megalm.transformer.moe.tracker import MoEMetricsTracker


class MoEState:
    """``metrics``: the :class:`MoEMetricsTracker` the routers record into;
    ``aux_loss_scale``: the main loss's backward factor (loss scale / number of micro-batches)
    that :class:`~megalm.transformer.moe.aux_losses.MoEAuxLossAutoScaler` gives the auxiliary
    losses in backward (1 until the trainer sets it)."""

    def __init__(self) -> None:
        self.metrics = MoEMetricsTracker()
        self.aux_loss_scale = 1.0

    def set_aux_loss_scale(self, scale: float) -> None:
        self.aux_loss_scale = float(scale)

    def begin_training_step(self, loss_scale: float, num_microbatches: int) -> None:
        """Set the auxiliary losses' backward factor and forget metrics that were never reported."""
        self.set_aux_loss_scale(loss_scale / num_microbatches)
        self.metrics.clear()

    def pop_metrics(self) -> Dict[str, torch.Tensor]:
        """What the routers recorded since the last call ({} for none, e.g. in evaluation)."""
        return self.metrics.pop() if self.metrics else {}

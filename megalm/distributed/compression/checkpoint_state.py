"""``--grad-compression``'s state as one registered checkpoint state (``"grad_compression"``).

Per rank (``grad_compression/rank_<rank>.pt``): the residuals, PowerSGD's ``Q``s and the rounding
generator with their signature (:func:`.state.compression_state`), restored exactly under the same
layout and settings.  In the DCP checkpoint, for any layout: every parameter's pending update and
PowerSGD's ``Q``s (:func:`.state.layout_free_specs`).  When the per-rank state does not apply (another
layout or other settings) the pending updates are resharded into this run's residuals (one INFO
line), or, when the checkpoint has none, the state restarts from zero (a warning).
"""

from __future__ import annotations

from typing import Optional, Sequence

from megalm.distributed.compression.state import (
    LayoutFreeState,
    compression_state,
    layout_free_specs,
    restore_compression_state,
    signature,
)
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.param_layout import model_parameters, tied_embedding_copies

logger = get_logger(__name__)


class CompressionCheckpointState:
    """``state_dict`` / ``load_state_dict`` (per rank) and ``sharded_state_dict`` / ``sharded_load_plan``
    (layout-free) of the compressors of ``model_chunks`` (DDP-wrapped chunks with a ``compressor``).
    ``layout``: the checkpoint's layout record of this run, part of the state's signature."""

    def __init__(self, model_chunks: Sequence, groups: ProcessGroups, layout: dict):
        self.model_chunks = model_chunks
        self.groups = groups
        self.layout = layout
        self._layout_free: Optional[LayoutFreeState] = None
        self._path = None

    def _tp(self) -> tuple:
        return group_rank(self.groups.tp), group_size(self.groups.tp)

    def state_dict(self) -> Optional[dict]:
        return compression_state(self.model_chunks, self.layout)

    def sharded_state_dict(self) -> dict:
        """Collective: the pending update is summed over the data-parallel group."""
        if signature(self.model_chunks, {}) is None:
            return {}
        params, copies = model_parameters(self.model_chunks), tied_embedding_copies(self.model_chunks)
        return layout_free_specs(self.model_chunks, params, copies, self._tp(), groups=self.groups)

    def sharded_load_plan(self, info) -> dict:
        self._path = info.path
        if signature(self.model_chunks, {}) is None:
            return {}
        params, copies = model_parameters(self.model_chunks), tied_embedding_copies(self.model_chunks)
        pp1 = group_size(self.groups.pp) == 1
        self._layout_free = LayoutFreeState(
            self.model_chunks, params, copies, self._tp(), info.saved_tensors, absorb_copies=pp1, groups=self.groups
        )
        return self._layout_free.specs

    def load_state_dict(self, state: dict) -> None:
        self._fall_back(restore_compression_state(self.model_chunks, self.layout, state))

    def not_restored(self, info, reason: str) -> None:
        saved = None if info.same_layout else {"signature": f"layout {info.saved_layout}"}
        self._fall_back(restore_compression_state(self.model_chunks, self.layout, saved))

    def _fall_back(self, why: Optional[str]) -> None:
        """The exact per-rank state did not apply (``why``): reshard the layout-free one, or warn."""
        if why is None:
            return
        if self._layout_free is not None and self._layout_free.found:
            done = self._layout_free.apply(self.model_chunks)
            logger.info(f"gradient-compression state resharded from {self._path} ({why}): {done}")
        else:
            logger.warning(
                f"gradient-compression state (error-feedback residuals) not restored from {self._path}: {why}; "
                f"it restarts from zero"
            )

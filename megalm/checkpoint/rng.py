"""This process's random number generators' states (Python, NumPy, torch CPU and CUDA, the
tensor-parallel tracker the model was given) as a dict of plain values and tensors (saved with
``torch.save``, read back with ``weights_only=True``), and :class:`RNGState`, the same as a
checkpoint state (saved to ``rng/rank_<rank>.pt`` unless ``--no-save-rng``).  No communication."""

from __future__ import annotations

import random
from typing import Dict, Optional

import numpy as np
import torch

from megalm.checkpoint.errors import CheckpointError
from megalm.log import get_logger
from megalm.tensor_parallel.random import RNGStatesTracker

logger = get_logger(__name__)


def get_rng_state(tracker: Optional[RNGStatesTracker]) -> Dict[str, object]:
    """The generators' states; ``"tracker"``: ``tracker``'s streams ({} without one)."""
    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
        "tracker": tracker.get_states() if tracker is not None else {},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, object], tracker: Optional[RNGStatesTracker]) -> None:
    """Restore what :func:`get_rng_state` returned; ``tracker``'s streams are replaced (when given)."""
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if tracker is not None:
        tracker.set_states(state["tracker"])


class RNGState:
    """The generators of this process and ``tracker`` (the model's, None: no tracker streams) as a
    checkpoint state: the trainer registers it as ``"rng"`` (``rng/rank_<rank>.pt``), with ``save``
    False under ``--no-save-rng`` (no file; ``common.json``'s ``rng_saved`` says so, and loading it
    needs ``--no-load-rng``).  Under the same layout the file is required."""

    required = True

    def __init__(self, tracker: Optional[RNGStatesTracker] = None, save: bool = True):
        self.tracker, self.save = tracker, save

    def state_dict(self) -> Optional[Dict[str, object]]:
        return get_rng_state(self.tracker) if self.save else None

    def local_state_dict(self) -> Dict[str, object]:
        """What a local checkpoint keeps: the generators, also under ``--no-save-rng``.  A local checkpoint
        resumes this same job after a failure, which continues as if uninterrupted; ``--no-save-rng`` is
        about the disk checkpoints a run leaves.  Restored, as from disk, through
        :func:`megalm.checkpoint.load.load_states` (``held=``), unless ``--no-load-rng``."""
        return get_rng_state(self.tracker)

    def load_state_dict(self, state: Dict[str, object]) -> None:
        set_rng_state(state, self.tracker)

    def common_state_dict(self) -> Dict[str, object]:
        return {"rng_saved": self.save}

    def load_common_state_dict(self, info) -> None:
        if not info.common.get("rng_saved", True):
            raise CheckpointError(f"{info.path} was saved with --no-save-rng: load it with --no-load-rng")

    def not_restored(self, info, reason: str) -> None:
        logger.info(
            f"checkpoint was saved with layout {info.saved_layout}, now {info.layout}: RNG states are not restored"
        )

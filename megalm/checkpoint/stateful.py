"""State that registers itself with the checkpointer.

A component with state (the model and its optimizer, the LR scheduler, the data position, the RNG,
gradient-compression residuals, local SGD's replicas and outer state, anything later)
implements torch.distributed.checkpoint's ``Stateful`` protocol, ``state_dict()`` /
``load_state_dict(state)``, and whoever builds it registers it under a name::

    states = CheckpointStates()
    states.register("grad_compression", CompressionCheckpointState(model, groups, layout(groups)))
    save_checkpoint_states(root, iteration, states, groups)
    load_checkpoint_states(root, states, groups)

The checkpointer names no component.  A state registered as ``NAME`` is saved by every rank to
``<iteration dir>/NAME/rank_<rank>.pt`` (``torch.save`` of ``state_dict()``: tensors and plain
values only, read back with ``torch.load(weights_only=True)``; a ``state_dict()`` of None writes
no file), listed in the rank's manifest.  On load each rank reads its own file when the
checkpoint was saved under this run's parallel layout and world size, and calls
``load_state_dict``; otherwise (another layout, or no file) it calls the state's
``not_restored(info, reason)`` if it has one.  A file that cannot be read, or a state that refuses
what it read, stops every rank with one ``CheckpointError`` naming the file (one
``all_gather_object`` per state: every rank must register the same names in the same order).

Optional methods, looked up by name:

* ``not_restored(info: LoadInfo, reason: str)``: the checkpoint has nothing for this rank under
  this layout (``reason`` says why, e.g. ``it was saved with layout {...}``).
* ``sharded_state_dict() -> ShardedStateDict`` (save; may be collective): blocks of global tensors
  (:class:`megalm.param_layout.ShardedTensorSpec`) that go into the DCP checkpoint with the model,
  so that any layout can read them.
* ``sharded_load_plan(info: LoadInfo) -> ShardedStateDict`` (load): the blocks to fill from the DCP
  checkpoint; called before ``load_state_dict`` / ``not_restored``, which can then use them.
* ``common_state_dict() -> dict`` (save): top-level entries of ``common.json`` (rank 0's values: JSON
  types only; a key the checkpointer or another state writes is refused), for small values every rank
  shares (the LR scheduler, the consumed samples).
* ``load_common_state_dict(info: LoadInfo)`` (load, every rank, any layout): restore them from
  ``info.common``; called before the per-rank file is read.
* ``required`` (attribute, True): under the same layout a missing file is an error, not ``not_restored``.
* ``local_state_dict()`` (a local checkpoint's save, :mod:`megalm.checkpoint.local`): what the in-memory
  copy keeps when it differs from ``state_dict()`` (the RNG: the generators even under ``--no-save-rng``).

A local checkpoint holds each rank's state dicts in memory instead of ``NAME/rank_*.pt``: a state restored
from it goes through the same :func:`load_rank_states` (``LoadInfo.held``, or ``held=`` of
:func:`megalm.checkpoint.load.load_states`), so one path restores a state from either.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from megalm.checkpoint.errors import CheckpointError, first_line, gather_errors
from megalm.param_layout import ShardedStateDict


@dataclasses.dataclass(frozen=True)
class LoadInfo:
    """What a registered state may want to know about the checkpoint being loaded."""

    path: str  # the iteration directory
    common: dict  # its common.json
    layout: dict  # this run's parallel layout record (common.json's "layout" of a save now)
    saved_tensors: Dict[str, tuple]  # names and global shapes of its DCP tensors
    held: Optional[Dict[str, object]] = None  # this rank's state dicts in memory (a local checkpoint's), else files

    @property
    def saved_layout(self) -> Optional[dict]:
        return self.common.get("layout")

    @property
    def same_layout(self) -> bool:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return self.common.get("layout") == self.layout and self.common.get("world_size", world) == world


class CheckpointStates:
    """The states registered with the checkpointer, by name, in registration order."""

    def __init__(self):
        self._states: Dict[str, Stateful] = {}

    def register(self, name: str, state: Stateful) -> None:
        if not name.isidentifier():
            raise ValueError(f"checkpoint state name {name!r} must be an identifier (it names a directory)")
        if name in self._states:
            raise ValueError(f"checkpoint state {name!r} is registered twice")
        if not isinstance(state, Stateful):
            raise TypeError(f"checkpoint state {name!r} has no state_dict()/load_state_dict()")
        self._states[name] = state

    def items(self) -> Iterator[Tuple[str, Stateful]]:
        return iter(self._states.items())

    def get(self, name: str) -> Stateful:
        """The state registered as ``name``."""
        return self._states[name]

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def __len__(self) -> int:
        return len(self._states)

    def without(self, *names: str) -> "CheckpointStates":
        """The same registrations less ``names`` (for a load that restores those later, or not at all)."""
        out = CheckpointStates()
        out._states = {k: v for k, v in self._states.items() if k not in names}
        return out

    def replaced(self, name: str, state: Stateful) -> "CheckpointStates":
        """The same registrations with ``name``'s state (registered) swapped for ``state``, in its place."""
        assert name in self._states, f"checkpoint state {name!r} is not registered"
        out = CheckpointStates()
        out._states = {k: (state if k == name else v) for k, v in self._states.items()}
        return out


def rank_file(path: str, name: str, rank: int) -> str:
    return os.path.join(path, name, f"rank_{rank:05d}.pt")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def sharded_states(states: Optional[CheckpointStates]) -> ShardedStateDict:
    """Save: the blocks every registered state puts into the DCP checkpoint (collective per state)."""
    specs: ShardedStateDict = {}
    for _, state in states.items() if states is not None else ():
        hook = getattr(state, "sharded_state_dict", None)
        if hook is not None:
            specs.update(hook())
    return specs


def common_states(states: Optional[CheckpointStates], taken) -> dict:
    """Save: the ``common.json`` entries of every registered state; ``taken``: the checkpointer's own keys."""
    entries: dict = {}
    for name, state in states.items() if states is not None else ():
        hook = getattr(state, "common_state_dict", None)
        for key, value in (hook() if hook is not None else {}).items():
            if key in taken or key in entries:
                raise CheckpointError(f"checkpoint state {name!r} writes common.json's {key!r}, which is taken")
            entries[key] = value
    return entries


def save_rank_states(path: str, states: Optional[CheckpointStates]) -> None:
    """Save: this rank's file of every registered state that has something to save.  No communication."""
    rank = _rank()
    for name, state in states.items() if states is not None else ():
        value = state.state_dict()
        if value is not None:
            os.makedirs(os.path.join(path, name), exist_ok=True)
            torch.save(value, rank_file(path, name, rank))


def sharded_load_plans(states: Optional[CheckpointStates], info: LoadInfo) -> ShardedStateDict:
    """Load: the blocks registered states read from the DCP checkpoint (filled by the same DCP load as the model)."""
    specs: ShardedStateDict = {}
    for _, state in states.items() if states is not None else ():
        hook = getattr(state, "sharded_load_plan", None)
        if hook is not None:
            specs.update(hook(info) or {})
    return specs


def load_rank_states(info: LoadInfo, states: Optional[CheckpointStates]) -> None:
    """Load: restore every registered state from ``common.json`` and this rank's file (see the module
    docstring).  Collective: one ``all_gather_object`` per state."""
    rank = _rank()
    for name, state in states.items() if states is not None else ():
        file = rank_file(info.path, name, rank)
        error = None
        hook = getattr(state, "load_common_state_dict", None)
        try:  # the same common.json on every rank: any other error is every rank's, raised as it is
            if hook is not None:
                hook(info)
        except CheckpointError as e:  # a state's own refusal (e.g. what common.json says it lacks)
            error = str(e)
        try:
            if error is None:
                _restore(state, name, file, info, bool(getattr(state, "required", False)))
        except Exception as e:  # noqa: BLE001 - torch.load's UnpicklingError (a refused pickle), OSError, a bad dict...
            error = f"cannot read {file}: {first_line(e)}"
        failed = gather_errors(error)  # a rank that cannot read its file stops every rank
        if failed:
            raise CheckpointError(failed[0][1])


def _restore(state: Stateful, name: str, file: str, info: LoadInfo, required: bool) -> None:
    held = info.held
    if info.same_layout and (required or (os.path.isfile(file) if held is None else name in held)):
        state.load_state_dict(torch.load(file, weights_only=True) if held is None else held[name])
        return
    reason = "it has none" if info.same_layout else f"it was saved with layout {info.saved_layout}"
    hook = getattr(state, "not_restored", None)
    if hook is not None:
        hook(info, reason)

"""Random-number streams of tensor parallelism and bit-exact activation recomputation.

Two streams, as in Megatron-LM's ``model_parallel_cuda_manual_seed``:

* the default generator of the compute device (CPU generator on CPU, the current CUDA
  generator on GPU) is seeded with ``seed`` on every TP rank, so dropout on replicated
  activations (embedding, hidden dropout without sequence parallelism) draws the same mask
  on every rank;
* the tracker's ``'model-parallel-rng'`` state is seeded with ``seed + 2718 + tp_rank``;
  code that works on TP-split activations (attention dropout on this rank's heads, all
  dropout under sequence parallelism) runs inside ``rng_tracker.fork()`` so every
  rank draws independent masks.

The tracker is an object, not a module global (Megatron-core's injectable tracker): whoever builds
the model creates it (:func:`model_parallel_manual_seed` returns a seeded one; the trainer's
:func:`megalm.training.initialize.set_random_seed`) and passes it as ``rng_tracker=`` to the model,
which hands the same one to every layer that forks it (dropout regions, keyed attention dropout,
recomputation).  One tracker per rank: a rank's model chunks share it, and the checkpoint saves it
(:class:`megalm.checkpoint.rng.RNGState`).

Pipeline stages are seeded apart (``seed + 100 * pp_rank``, :func:`megalm.training.initialize.set_random_seed`);
data-parallel ranks share the seed, as in Megatron without ``--data-parallel-random-init``.  On a CPU the
default generator is also the one every other CPU draw uses, so nothing that runs on some TP ranks only
may draw from it: DataLoaders (iterated on TP rank 0 alone) have their own generator
(:mod:`megalm.data.loaders`), and the device-peak measurement runs before the checkpoint's RNG state is
restored.

:func:`checkpoint` recomputes a function in backward with every stream restored to its
forward state, so recomputation is bit-identical to the original forward pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch

from megalm.device import use_cuda
from megalm.parallel_state import ProcessGroups, group_rank

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
EXPERT_PARALLEL_SEED_OFFSET = 1024


# --- the device's default generator ------------------------------------------------------


def get_device_rng_state() -> torch.Tensor:
    """State of the compute device's default generator (CUDA when used, else CPU)."""
    return torch.cuda.get_rng_state() if use_cuda() else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _state_for_seed(seed: int) -> torch.Tensor:
    """Generator state a fresh device generator seeded with ``seed`` would have."""
    if use_cuda():
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state
    return torch.Generator().manual_seed(seed).get_state()


# --- tracker -----------------------------------------------------------------------------


class RNGStatesTracker:
    """Named generator states that can be swapped in for the device's default generator.

    ``fork(name)`` is re-entrant: a fork of the stream that is already active is a no-op, so
    nested regions (attention dropout inside a sequence-parallel block) draw from one stream.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._states: Dict[str, torch.Tensor] = {}
        self._seeds: set = set()
        self._active: Optional[str] = None

    def is_initialized(self) -> bool:
        return bool(self._states)

    def active_stream(self) -> Optional[str]:
        """Name of the stream whose fork is open (its state lives in the device generator), or None."""
        return self._active

    @contextlib.contextmanager
    def resume(self, name: Optional[str]):
        """Treat ``name`` as the open fork inside the block (recomputation of a region that ran in a fork)."""
        outer, self._active = self._active, name
        try:
            yield
        finally:
            self._active = outer

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copies of every named state (for checkpoints and recomputation)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the named states (from :meth:`get_states` or a checkpoint)."""
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already used by another RNG stream")
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._seeds.add(seed)
        self._states[name] = _state_for_seed(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw from stream ``name`` inside the block; the default stream is left untouched."""
        if self._active == name:
            yield
            return
        if name not in self._states:
            raise RuntimeError(
                f"RNG stream {name!r} is not initialized; call "
                "megalm.tensor_parallel.model_parallel_manual_seed(seed) first"
            )
        outer_state, outer_active = get_device_rng_state(), self._active
        set_device_rng_state(self._states[name])
        self._active = name
        try:
            yield
        finally:
            self._states[name] = get_device_rng_state()
            set_device_rng_state(outer_state)
            self._active = outer_active


def model_parallel_manual_seed(
    seed: int, groups: ProcessGroups, tracker: Optional[RNGStatesTracker] = None
) -> RNGStatesTracker:
    """Seed the default generators with ``seed`` (same on every TP rank) and the tracker's
    ``'model-parallel-rng'`` stream with ``seed + 2718 + tp_rank`` (distinct per TP rank);
    ``'expert-parallel-rng'`` gets ``seed + 1024 + 100 * ep_rank + tp_rank``.  The ranks are this
    rank's in ``groups.tp`` and ``groups.ep``.

    Callers that want different streams per pipeline stage or data-parallel rank offset
    ``seed`` before calling (Megatron adds ``100 * pp_rank``).

    Returns ``tracker`` (re-seeded: its streams are replaced), or a new one when None: pass it to
    the model (``rng_tracker=``).
    """
    torch.manual_seed(seed)  # CPU and every CUDA device
    tp_rank, ep_rank = group_rank(groups.tp), group_rank(groups.ep)
    tracker = RNGStatesTracker() if tracker is None else tracker
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    # Dropout inside expert layers (expert tensor parallel = tensor parallel), as Megatron.
    tracker.add(EXPERT_PARALLEL_RNG, seed + EXPERT_PARALLEL_SEED_OFFSET + 100 * ep_rank + tp_rank)
    return tracker


def get_all_rng_states(tracker: Optional[RNGStatesTracker]) -> Dict[str, Any]:
    """CPU, CUDA (when used) and ``tracker``'s states (none without one): what a recomputation needs
    to draw the same masks."""
    streams = tracker.get_states() if tracker is not None else {}
    states: Dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": streams}
    if use_cuda():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_all_rng_states(states: Dict[str, Any], tracker: Optional[RNGStatesTracker]) -> None:
    torch.set_rng_state(states["cpu"])
    if use_cuda() and states.get("cuda") is not None:
        torch.cuda.set_rng_state(states["cuda"])
    if tracker is not None:
        tracker.set_states(states["tracker"])


def dropout_rng(tracker: RNGStatesTracker, p: float, model_parallel_rng: bool):
    """Context for drawing a dropout mask of probability ``p``: ``tracker``'s model-parallel
    stream when ``model_parallel_rng`` (activations that differ per TP rank: sequence-parallel
    slices, TP-split heads) and ``p > 0``, else the default stream (replicated activations:
    identical masks on every TP rank)."""
    return tracker.fork() if p > 0.0 and model_parallel_rng else contextlib.nullcontext()


def dropout(
    x: torch.Tensor, p: float, training: bool, tracker: RNGStatesTracker, model_parallel_rng: bool = False
) -> torch.Tensor:
    """``F.dropout`` drawing from the stream :func:`dropout_rng` picks."""
    if not training or p == 0.0:
        return x
    with dropout_rng(tracker, p, model_parallel_rng):
        return torch.nn.functional.dropout(x, p, True)


# --- activation recomputation ------------------------------------------------------------


def _autocast_state() -> tuple:
    device_type = "cuda" if use_cuda() else "cpu"
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _CheckpointFunction(torch.autograd.Function):
    """Forward without saving activations; backward recomputes them under the saved RNG states."""

    @staticmethod
    def forward(ctx, run_function, tracker, *args):
        ctx.run_function, ctx.tracker = run_function, tracker
        ctx.rng_states = get_all_rng_states(tracker)
        ctx.active_stream = tracker.active_stream() if tracker is not None else None
        ctx.autocast = _autocast_state()
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.non_tensor_args)
        for position, saved in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[position] = saved.detach().requires_grad_(saved.requires_grad)
        tracker = ctx.tracker
        states_before_recompute = get_all_rng_states(tracker)
        set_all_rng_states(ctx.rng_states, tracker)
        device_type, autocast_on, autocast_dtype = ctx.autocast
        try:
            with (
                torch.enable_grad(),
                torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on),
                tracker.resume(ctx.active_stream) if tracker is not None else contextlib.nullcontext(),
            ):
                outputs = ctx.run_function(*args)
        finally:
            set_all_rng_states(states_before_recompute, tracker)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + grads


def checkpoint(function, *args, rng_tracker: Optional[RNGStatesTracker]):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    The default generator states (CPU, CUDA) and ``rng_tracker``'s streams (the one the layers
    inside ``function`` fork) are saved before the forward and restored for the recomputation, so
    dropout masks are identical.  ``rng_tracker=None`` (said explicitly) for a function that forks no
    tracker stream (an activation, an MLP): only the default generators are restored.  Without
    grad mode, or when no tensor argument requires grad (parameters alone would receive no
    gradient through a recomputed region), ``function`` runs normally.
    """
    if not torch.is_grad_enabled() or not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return function(*args)
    return _CheckpointFunction.apply(function, rng_tracker, *args)

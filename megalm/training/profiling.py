"""Megatron-LM's ``--profile``: record a window of training iterations on chosen ranks.

Iterations are counted as the trainer counts them: the step that runs when ``n`` iterations are
done is step ``n``.  With ``--profile-step-start a --profile-step-end b`` steps ``a .. b-1`` are
recorded (``b - a`` steps), on the ranks in ``--profile-ranks``:

* ``--use-pytorch-profiler``: ``torch.profiler`` with CPU (and CUDA) activities and shapes; step
  ``a - 1`` runs as the profiler's warm-up and is discarded (as Megatron's schedule of
  ``wait = a - 1, warmup = 1, active = b - a``).  The trace is written to ``--tensorboard-dir`` as
  ``rank<r>.<time>.pt.trace.json`` (TensorBoard's profiler plugin, Perfetto or chrome://tracing
  open it); each step is a ``ProfilerStep#<k>`` range.
* otherwise (CUDA only, for ``nsys profile --capture-range=cudaProfilerApi``):
  ``cudaProfilerStart`` before step ``a``, NVTX ranges per operator, ``cudaProfilerStop`` after
  step ``b - 1``.

A run resumed past ``a`` records nothing (the window is in absolute iterations) and says so.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megalm.device import use_cuda
from megalm.errors import MegalmError


class ProfilerUnavailable(MegalmError, RuntimeError):
    """``--profile`` asked for the nsys path on a machine without CUDA."""


def check_profiler_available(logging_cfg) -> None:
    """Raise :class:`ProfilerUnavailable` when ``--profile`` asks for nsys (no
    ``--use-pytorch-profiler``) on a machine without CUDA."""
    lg = logging_cfg
    if lg.profile and not lg.use_pytorch_profiler and not use_cuda():
        raise ProfilerUnavailable(
            "--profile without --use-pytorch-profiler drives nsys through CUDA and this "
            "machine has no GPU: add --use-pytorch-profiler (and --tensorboard-dir)"
        )


class StepProfiler:
    """Hooks the training loop calls around each step; does nothing on ranks not profiled.

    Args:
        logging_cfg: :class:`megalm.config.sections.LoggingConfig` (``--profile*`` flags).
        rank: this process's global rank.
    """

    def __init__(self, logging_cfg, rank: int):
        lg = logging_cfg
        self.enabled = bool(lg.profile) and rank in lg.profile_ranks
        self.start_step, self.end_step = lg.profile_step_start, lg.profile_step_end
        self.torch_profiler = bool(lg.use_pytorch_profiler)
        self.trace_dir: Optional[str] = lg.tensorboard_dir
        self.rank = rank
        self._prof = None
        self._nvtx: Optional[contextlib.AbstractContextManager] = None
        if self.enabled:
            check_profiler_available(lg)

    def note_on_resume(self, iteration: int) -> Optional[str]:
        """A warning when training starts (at ``iteration``) past the profiled window's start."""
        if self.enabled and iteration > max(self.start_step - 1, 0):
            return (
                f"--profile-step-start {self.start_step} is before the resumed iteration {iteration}: "
                f"nothing is profiled"
            )
        return None

    # --- hooks ------------------------------------------------------------------------------------
    def before_step(self, iteration: int) -> None:
        """Called with the iterations done so far, before the step runs."""
        if not self.enabled:
            return
        if self.torch_profiler and iteration == max(self.start_step - 1, 0) and self._prof is None:
            self._prof = self._make_torch_profiler(warmup=1 if self.start_step > 0 else 0)
            self._prof.start()
        elif not self.torch_profiler and iteration == self.start_step:
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """Called with the iterations done, after the step."""
        if not self.enabled:
            return
        if self._prof is not None:
            self._prof.step()
        if iteration == self.end_step:
            self.close()

    def close(self) -> None:
        """Stop (writing the trace of the steps recorded so far); safe to call more than once."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.profiler.stop()

    def _make_torch_profiler(self, warmup: int):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda() else [])
        return profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=self.end_step - self.start_step, repeat=1),
            on_trace_ready=tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}"),
            record_shapes=True,
        )

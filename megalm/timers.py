"""Megatron-LM's per-phase timers: ``--timing-log-level``, ``--timing-log-option``,
``--log-timers-to-tensorboard``, ``--no-barrier-with-level-1-timing``.

What is timed, and at which level (a timer above ``--timing-log-level`` is a no-op that costs
nothing: no device synchronization, no barrier):

====  ===========================================================================================
0     ``model-and-optimizer-setup`` (includes loading a checkpoint),
      ``train/valid/test-data-iterators-setup`` (printed once after set-up), ``save-checkpoint``
      (printed after each save)
1     ``forward-backward`` (the schedule over all microbatches), ``all-grads-sync`` (finishing the
      data-parallel gradient reduction), ``layernorm-grads-all-reduce`` (sequence-parallel norm
      gradients over TP), ``embedding-grads-all-reduce`` (tied embeddings over the first and last
      stage), ``optimizer`` and its parts ``optimizer-copy-to-main-grad``,
      ``optimizer-unscale-and-check-inf``, ``optimizer-clip-main-grad`` (norm and clipping),
      ``optimizer-inner-step``, ``optimizer-copy-main-to-model-params``, ``params-all-gather``
      (distributed optimizer: its launch when ``--overlap-param-gather``), ``local-sgd-sync``
      (``--local-sgd-interval``: the replicas' parameter averaging and outer step)
2     ``batch-generator`` (``next()`` on the data iterator: reading and collating a microbatch;
      the tensor-parallel broadcast of the batch falls in ``forward-compute``),
      ``forward-compute``, ``backward-compute``, and the pipeline exchanges ``forward-recv``,
      ``forward-send``, ``backward-recv``, ``backward-send``, ``forward-send-backward-recv``,
      ``backward-send-forward-recv``, ``forward-send-forward-recv``,
      ``backward-send-backward-recv``, ``forward-backward-send-forward-backward-recv``
====  ===========================================================================================

Each timer accumulates over the iterations between two log lines; the log shows the time per
iteration (accumulated / iterations) in milliseconds, gathered from every rank (one
``all_gather`` over the world, collective: every rank calls :meth:`Timers.log`):

* ``minmax`` (default): ``(min, max)`` over the ranks that ran the timer;
* ``max``: the slowest rank;
* ``all``: every rank.

Each running timer is also a ``record_function`` range, so ``--profile --use-pytorch-profiler``
traces show the phases by these names.  On CUDA a timer synchronizes the device at start and
stop, so a phase's time includes its kernels; level-1 timers also start with a barrier over the world (unless
``--no-barrier-with-level-1-timing``) so that waiting for other ranks is not counted as work.
TensorBoard (``--log-timers-to-tensorboard``) and the metrics file get ``<name>-time``: the
slowest rank's seconds per iteration, as Megatron writes it.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device, synchronize
from megalm.errors import MegalmError

TIMER_LEVELS: Dict[str, int] = {
    "model-and-optimizer-setup": 0,
    "train/valid/test-data-iterators-setup": 0,
    "save-checkpoint": 0,
    "forward-backward": 1,
    "all-grads-sync": 1,
    "layernorm-grads-all-reduce": 1,
    "embedding-grads-all-reduce": 1,
    "optimizer": 1,
    "optimizer-copy-to-main-grad": 1,
    "optimizer-unscale-and-check-inf": 1,
    "optimizer-clip-main-grad": 1,
    "optimizer-inner-step": 1,
    "optimizer-copy-main-to-model-params": 1,
    "params-all-gather": 1,
    "local-sgd-sync": 1,
    "batch-generator": 2,
    "forward-compute": 2,
    "backward-compute": 2,
    "forward-recv": 2,
    "forward-send": 2,
    "backward-recv": 2,
    "backward-send": 2,
    "forward-send-backward-recv": 2,
    "backward-send-forward-recv": 2,
    "forward-send-forward-recv": 2,
    "backward-send-backward-recv": 2,
    "forward-backward-send-forward-backward-recv": 2,
}
SETUP_TIMERS = ["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"]
ITERATION_TIMERS = [name for name, level in TIMER_LEVELS.items() if level > 0]  # Megatron's order
# Timed at every level under --log-straggler (its compute time, megalm/training/stragglers.py);
# printed only at level 2.
COMPUTE_TIMERS = ("forward-compute", "backward-compute")
LOG_OPTIONS = ("max", "minmax", "all")


class TimerError(MegalmError, RuntimeError):
    """A timer was started twice or stopped without being started."""


class NullTimer:
    """A timer above the log level: every call does nothing."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def __enter__(self) -> "NullTimer":
        return self

    def __exit__(self, *exc) -> None:
        pass


NULL_TIMER = NullTimer()


class NullTimers:
    """No timing at all (what schedules and optimizers use when given no timers)."""

    log_level = -1

    def __call__(self, name: str, log_level: Optional[int] = None) -> NullTimer:
        return NULL_TIMER


NULL_TIMERS = NullTimers()


class Timer:
    """Accumulates the seconds between ``start()`` and ``stop()`` calls."""

    def __init__(
        self,
        name: str,
        clock: Callable[[], float] = time.perf_counter,
        synchronize_device: Callable[[], None] = synchronize,
        barrier_on_start: bool = False,
    ):
        self.name = name
        self._clock = clock
        self._synchronize = synchronize_device
        self.barrier_on_start = barrier_on_start
        self._elapsed = 0.0
        self._started_at: Optional[float] = None
        self._range = None

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self, barrier: Optional[bool] = None) -> None:
        if self.running:
            raise TimerError(f"timer {self.name!r} was started twice without stop()")
        if (self.barrier_on_start if barrier is None else barrier) and dist.is_initialized():
            dist.barrier()
        self._synchronize()
        self._range = torch.autograd.profiler.record_function(self.name)  # a named range in --profile traces
        self._range.__enter__()
        self._started_at = self._clock()

    def stop(self, barrier: bool = False) -> None:
        if not self.running:
            raise TimerError(f"timer {self.name!r} was stopped without start()")
        if barrier and dist.is_initialized():
            dist.barrier()
        self._synchronize()
        self._elapsed += self._clock() - self._started_at
        self._started_at = None
        self._range.__exit__(None, None, None)
        self._range = None

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (a running timer counts up to now and keeps running)."""
        total = self._elapsed
        if self.running:
            now = self._clock()
            total += now - self._started_at
            if reset:
                self._started_at = now
        if reset:
            self._elapsed = 0.0
        return total

    def __enter__(self) -> "Timer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Timers:
    """The run's timers by name (one object, passed explicitly to what it times).

    Args:
        log_level: ``--timing-log-level``; timers above it are :data:`NULL_TIMER`.
        log_option: ``--timing-log-option``: ``max``, ``minmax`` or ``all``.
        barrier_with_level_1: level-1 timers start with a world barrier.
        always_on: timers kept running at every level (``--log-straggler``'s
            :data:`COMPUTE_TIMERS`); they appear in the timing block only at their level.
        clock, synchronize_device: injected in tests.
    """

    def __init__(
        self,
        log_level: int = 0,
        log_option: str = "minmax",
        barrier_with_level_1: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        synchronize_device: Callable[[], None] = synchronize,
        always_on: Sequence[str] = (),
    ):
        if log_level not in (0, 1, 2):
            raise ValueError(f"timing log level must be 0, 1 or 2, got {log_level}")
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"timing log option must be one of {LOG_OPTIONS}, got {log_option!r}")
        self.log_level = log_level
        self.log_option = log_option
        self.barrier_with_level_1 = barrier_with_level_1
        self._clock = clock
        self._synchronize = synchronize_device
        self.always_on = frozenset(always_on)
        self._timers: Dict[str, Timer] = {}

    @classmethod
    def from_config(cls, logging_cfg) -> "Timers":
        return cls(
            logging_cfg.timing_log_level,
            logging_cfg.timing_log_option,
            logging_cfg.barrier_with_level_1_timing,
            always_on=COMPUTE_TIMERS if logging_cfg.log_straggler else (),
        )

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer ``name`` (created on first use); its level comes from :data:`TIMER_LEVELS`
        unless given.  Above the log level: :data:`NULL_TIMER`."""
        level = TIMER_LEVELS.get(name) if log_level is None else log_level
        if level is None:
            raise ValueError(f"timer {name!r} has no level in TIMER_LEVELS: pass log_level=")
        if level > self.log_level and name not in self.always_on:
            return NULL_TIMER
        if name not in self._timers:
            self._timers[name] = Timer(
                name, self._clock, self._synchronize, barrier_on_start=level == 1 and self.barrier_with_level_1
            )
        return self._timers[name]

    def names_at_level(self, names: Iterable[str]) -> List[str]:
        return [n for n in names if TIMER_LEVELS.get(n, 0) <= self.log_level]

    # --- across ranks --------------------------------------------------------------------------
    def gather(self, names: Sequence[str], reset: bool = True) -> torch.Tensor:
        """``[world, len(names)]`` seconds, 0 where a rank never ran a timer (collective)."""
        local = torch.tensor(
            [self._timers[n].elapsed(reset) if n in self._timers else 0.0 for n in names], dtype=torch.float64
        )
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local.unsqueeze(0)
        local = local.to(get_device())
        every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(every, local)
        return torch.stack(every).cpu()

    def report(
        self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True
    ) -> Tuple[Optional[str], Dict[str, float]]:
        """From one gather (collective over the world): the timing block for ``names`` (None when
        nothing ran) and ``{"<name>-time": slowest rank's seconds / normalizer}`` for the timers
        that ran (what the writers get)."""
        names = self.names_at_level(names)
        if not names:
            return None, {}
        times = self.gather(names, reset)
        slowest = {
            f"{n}-time": float(times[:, i].max()) / normalizer for i, n in enumerate(names) if (times[:, i] > 0).any()
        }
        return format_times(names, times, normalizer, self.log_option), slowest

    def log(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True) -> Optional[str]:
        """The timing block for ``names`` (collective over the world; None when nothing ran)."""
        return self.report(names, normalizer, reset)[0]


def format_times(names: Sequence[str], times: torch.Tensor, normalizer: float, option: str) -> Optional[str]:
    """Megatron's timing block from ``[world, names]`` seconds; ranks with 0 did not run a timer."""
    lines = []
    for i, name in enumerate(names):
        ran = [(rank, float(t) * 1000.0 / normalizer) for rank, t in enumerate(times[:, i]) if t > 0]
        if not ran:
            continue
        ms = [t for _, t in ran]
        label = (name + " ").ljust(48, ".")
        if option == "minmax":
            lines.append(f"    {label}: ({min(ms):.2f}, {max(ms):.2f})")
        elif option == "max":
            lines.append(f"    {label}: {max(ms):.2f}")
        else:
            lines.append(f"    {name}:" + "".join(f"\n     rank {rank:2d}: {t:.2f}" for rank, t in ran))
    if not lines:
        return None
    header = {
        "minmax": "(min, max) time across ranks (ms):",
        "max": "max time across ranks (ms):",
        "all": "times across ranks (ms):",
    }[option]
    return "\n".join([header] + lines)


def timed_iterator(data_iterator, timer):
    """``data_iterator`` (or each of a list of them) with ``next()`` timed by ``timer``; None stays None."""
    if data_iterator is None or timer is NULL_TIMER:
        return data_iterator
    if isinstance(data_iterator, (list, tuple)):
        return [timed_iterator(it, timer) for it in data_iterator]
    return _TimedIterator(data_iterator, timer)


class _TimedIterator:
    def __init__(self, source, timer):
        self.source = source
        self.timer = timer

    def __iter__(self):
        return self

    def __next__(self):
        with self.timer:
            return next(self.source)

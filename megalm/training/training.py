"""The training loop: ``pretrain(...)`` as in Megatron-LM, in readable pieces.

Per iteration: the training step (:func:`megalm.training.step.train_step`: schedule over the
microbatches, gradient finalization, optimizer step, learning-rate step, counters), the numerics
checks (:mod:`megalm.training.loss_checks`: a non-finite or spiky loss stops every rank before
anything of that iteration is logged or saved), logging, evaluation, checkpoint, exit checks.
The :class:`Trainer` builds the rank's :class:`megalm.parallel_state.ProcessGroups` once
(``self.groups``) and passes it down.

Errors are raised as :class:`megalm.errors.MegalmError` subclasses (a stop on purpose, e.g.
``--exit-interval``, as :class:`megalm.errors.TrainingStopped` with exit code 0); the entry point
(``pretrain_gpt.py``) turns them into a message and an exit code.  Messages go through
:mod:`megalm.log`.  The Trainer's set-up (what a run builds before its first iteration) is
:mod:`megalm.training.trainer_setup`, its log line and evaluation :mod:`megalm.training.trainer_reporting`
(two mixins); building the model chunks lives in :mod:`megalm.training.build`, the log-line
bookkeeping (:class:`IntervalStats`, the reporting rank) in :mod:`megalm.training.log_interval`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.checkpoint.async_writer import AsyncSaveError
from megalm.checkpoint.model_state import finish_param_sync
from megalm.checkpoint.resume import non_persistent_dir
from megalm.checkpoint.save import remove_older_checkpoints, save_checkpoint_states
from megalm.checkpoint.stateful import CheckpointStates
from megalm.config import ConfigError, MegalmConfig, parse_config
from megalm.device import get_device
from megalm.distributed.collective_errors import named_collective_failures
from megalm.errors import MegalmError, TrainingStopped
from megalm.log import get_logger
from megalm.training.initialize import world_size_from_env
from megalm.training.local_checkpoint import describe_save
from megalm.training.log_interval import IntervalStats, print_timing
from megalm.training.loss_checks import NumericsStop
from megalm.training.step import StepResult, TrainState, train_step
from megalm.training.trainer_reporting import TrainerReporting
from megalm.training.trainer_setup import TrainerSetup, TrainingSetupError

logger = get_logger(__name__)

__all__ = ["Trainer", "TrainState", "TrainingSetupError", "CheckpointSaveFailed", "pretrain"]


class CheckpointSaveFailed(MegalmError):
    """A background checkpoint save (--async-save) failed on some rank."""


# --- the loop ----------------------------------------------------------------------------


def pretrain(
    model_provider: Callable,
    forward_step_func: Callable,
    argv: Optional[Sequence[str]] = None,
    cfg: Optional[MegalmConfig] = None,
    extra_validation: Optional[Callable] = None,
) -> TrainState:
    """Megatron-LM's ``pretrain``: parse flags, build everything, train, evaluate, save.

    ``model_provider(cfg, pre_process, post_process, layer_numbers, *, process_groups, rng_tracker) -> nn.Module`` and
    ``forward_step_func(data_iterator, model) -> (output, loss_func)``.
    """
    if cfg is None:
        cfg = parse_config(list(argv) if argv is not None else None, world_size=world_size_from_env())
    if cfg.parallel.auto_layout:
        raise ConfigError("--auto-layout is resolved by pretrain_gpt.py (megalm.planner.auto.auto_layout_argv)")
    if extra_validation is not None:
        extra_validation(cfg)
    run = Trainer(cfg, model_provider, forward_step_func)
    # A collective's timeout or lost peer, anywhere in the run, becomes an error naming its group.
    with named_collective_failures(lambda: run.groups, cfg.parallel.distributed_timeout_minutes * 60):
        return run.run()


class Trainer(TrainerSetup, TrainerReporting):
    """Holds what one run builds; ``run()`` trains.  Kept small: each step is a method; ``setup()`` and
    its helpers are :class:`~megalm.training.trainer_setup.TrainerSetup`'s, the log line and evaluation
    :class:`~megalm.training.trainer_reporting.TrainerReporting`'s."""

    def __init__(self, cfg: MegalmConfig, model_provider: Callable, forward_step_func: Callable):
        self.cfg = cfg
        self.model_provider = model_provider
        self.forward_step_func = forward_step_func
        self.state = TrainState()
        self.groups = parallel_state.get_process_groups()  # rebuilt in setup(), after initialization
        self.interval = IntervalStats()  # values since the last log line
        self.saved_at: Optional[int] = None  # iteration of the last checkpoint saved by the loop
        self.stragglers = None  # --log-straggler: built in setup()
        self.watchdog = None  # --hang-watchdog-seconds: running during train()
        self.data_iterators = None  # DataIterators, built in setup(); closed when run() ends
        self.optimizer = None  # built in setup(); closed when run() ends (NVMe offload: its swap files)
        self.rebalancer = None  # --straggler-rebalance-interval: built in setup()
        self.replicas = None  # --ft-replica-group-id: torchft's replica groups, joined at the end of setup()
        self.checkpoint_states = CheckpointStates()  # what components register with the checkpointer, in setup()
        self.local_checkpoint_states = CheckpointStates()  # the same for a local checkpoint: keeps everything
        self.local_checkpoint = None  # --non-persistent-ckpt-type local: built in setup()
        self.rng_tracker = None  # the rank's seeded RNG tracker (model chunks, checkpoints), from setup()

    # -- set-up --

    def save_local(self) -> None:
        """A local checkpoint of this iteration (collective)."""
        state = self.state
        # every registered state, also under --no-save-optim / --no-save-rng (the local states keep all)
        states = self.local_checkpoint_states
        outcome = self.local_checkpoint.save(state.iteration, self.cfg.to_dict(), states, self.groups)
        logger.info(describe_save(self.local_checkpoint, state.iteration, outcome))

    # -- the loop --
    def run(self) -> TrainState:
        """Set up, train, evaluate; however it ends, the DataLoader workers are stopped (an exception's
        traceback would keep them, which ignore SIGTERM, alive: the process would hang at exit)."""
        try:
            self.setup()
            return self._train_and_evaluate()
        finally:
            if self.data_iterators is not None:
                self.data_iterators.close()
            if self.local_checkpoint is not None:
                self.local_checkpoint.close()  # no copy left running past the run
            if self.replicas is not None:
                self.replicas.close()
            if self.optimizer is not None:
                self.optimizer.close()

    def _train_and_evaluate(self) -> TrainState:
        cfg, state = self.cfg, self.state
        try:
            if not cfg.training.skip_train and state.iteration < self.train_iters:
                self.train()
            if self.do_valid:
                self.evaluate_and_log("validation", self.valid_iter)
            if self.do_test:
                self.evaluate_and_log("test", self.test_iter)
        finally:
            self.metrics.close()
            if self.stragglers is not None:
                self.stragglers.close()
        return state

    def train(self) -> None:
        """Iterations until --train-iters (or an exit condition: :class:`TrainingStopped`)."""
        cfg, state = self.cfg, self.state
        for chunk in self.model:
            chunk.train()
        self.interval = IntervalStats()
        self.saved_at = None
        note = self.profiler.note_on_resume(state.iteration)
        if note:
            logger.warning(note)
        self.watchdog = self._hang_watchdog()
        deadline = self._first_step_deadline()
        try:
            if deadline is not None and state.iteration < self.train_iters:
                self._first_step_watched(deadline)
            while state.iteration < self.train_iters:
                self.train_iteration()
        finally:
            if deadline is not None:
                deadline.close()
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
        self.profiler.close()  # a window past the last iteration: keep what was recorded
        finish_param_sync(self.model)  # the last step's overlapped parameter all-gathers
        if cfg.checkpoint.save and self.saved_at != state.iteration:
            self.save()
        self.complete_async_save()
        if self.local_checkpoint is not None:
            self.local_checkpoint.remove_all()  # the run is over: free the nodes' RAM

    def _rebalance(self) -> None:
        """Re-plan the replicas' micro-batch shares (collective); on a change, the reading ranks'
        train iterator restarts at the consumed samples with the new split."""
        shares = self.rebalancer.replan()
        loader = self.data_iterators.train_loader if self.data_iterators is not None else None
        if shares is None or loader is None:
            return
        loader.batch_sampler.shares = list(shares)
        loader.batch_sampler.consumed_samples = self.state.consumed_train_samples
        self.train_iter = iter(loader)

    def _first_step_watched(self, deadline) -> None:
        """The first iteration, telling ``deadline`` when this rank has read its first batch (at
        once on ranks that read none) and when the step is done."""
        from megalm.training.first_step import STAGES

        train_iter, marked = self.train_iter, None
        if train_iter is None:
            deadline.reached(STAGES[1])
        else:

            def first_batch_marked():
                for batch in train_iter:
                    deadline.reached(STAGES[1])
                    yield batch
                    break
                yield from train_iter

            self.train_iter = marked = first_batch_marked()
        try:
            self.train_iteration()
        finally:
            if self.train_iter is marked:  # not restarted by the step (torchft restarts it)
                self.train_iter = train_iter
        deadline.step_done()

    def _progress(self, where: str) -> None:
        """Mark progress for the hang watchdog (a clock read; nothing without one)."""
        if self.watchdog is not None:
            self.watchdog.progress(where)

    def train_iteration(self) -> StepResult:
        """One iteration of the loop: the step, then its log line, evaluation, checkpoint and
        exit checks when due (call :meth:`train` for a run; this is its body)."""
        cfg, state, t = self.cfg, self.state, self.cfg.training
        self._progress(f"iteration {state.iteration + 1} started")
        self.profiler.before_step(state.iteration)
        start = time.perf_counter()

        def step(data_iterator):
            return train_step(
                cfg,
                self.forward_step_func,
                data_iterator,
                self.model,
                self.optimizer,
                self.scheduler,
                state,
                self.microbatches,
                self.groups,
                self.timers,
                self.outer_sync,
                self.rebalancer,
                self.replicas,
                self.comm_stats,
            )

        if self.replicas is None:
            result = step(self.train_iter)
        else:  # torchft: quorum first (a returning group recovers here), redone until committed
            loader = self.data_iterators.train_loader if self.data_iterators is not None else None
            result, self.train_iter = self.replicas.step(step, self.train_iter, loader)
        self.check_numerics(result)
        if self.rebalancer is not None and state.iteration % self.rebalancer.interval == 0:
            self._rebalance()
        self.interval.add(time.perf_counter() - start, result)
        self._progress(f"iteration {state.iteration} step done")
        self.profiler.after_step(state.iteration)
        if state.iteration % cfg.logging.log_interval == 0:
            self.log_training(self.interval)
            self.interval = IntervalStats()
        elif self._writes_iteration_scalars(state.iteration):
            self.log_iteration_scalars(result)
        if (
            self.do_valid
            and t.eval_interval
            and state.iteration % t.eval_interval == 0
            and state.iteration < self.train_iters
        ):
            self.evaluate_and_log("validation", self.valid_iter)
            self._progress(f"iteration {state.iteration} evaluated")
        c = cfg.checkpoint
        if c.save and c.save_interval and state.iteration % c.save_interval == 0:
            self.save()
            self.saved_at = state.iteration
            self._progress(f"iteration {state.iteration} saved")
        elif (
            c.non_persistent_save_interval
            and c.non_persistent_ckpt_type != "local"
            and state.iteration % c.non_persistent_save_interval == 0
        ):
            self.save(non_persistent_dir(c, c.save))
            self._progress(f"iteration {state.iteration} saved (non-persistent)")
        if self.local_checkpoint is not None and state.iteration % c.non_persistent_save_interval == 0:
            self.save_local()
            self._progress(f"iteration {state.iteration} saved (local)")
        reason = self.exit_reason()
        if reason:
            self.stop(reason)
        return result

    def check_numerics(self, result: StepResult) -> None:
        """Non-finite loss or gradient norm, fp16 overflows at the minimum scale, spiky loss
        (:class:`megalm.training.loss_checks.NumericsChecks`): on a stop, the background save in
        flight (an earlier, finite iteration) is finished and nothing else is saved."""
        try:
            self.numerics.check(self.state.iteration, result)
        except NumericsStop as e:
            self.profiler.close()
            self.complete_async_save()
            last = f"; last checkpoint saved by this run: iteration {self.saved_at}" if self.saved_at else ""
            raise type(e)(f"{e}{last}") from None

    def stop(self, reason: str) -> None:
        """Save if not saved at this iteration, finish background work, raise :class:`TrainingStopped`."""
        state, c = self.state, self.cfg.checkpoint
        if c.save and self.saved_at != state.iteration:
            self.save()
        self.complete_async_save()
        message = f"exiting at iteration {state.iteration}: {reason}"
        logger.info(message)
        self.profiler.close()
        finish_param_sync(self.model)  # overlapped parameter all-gathers
        self.metrics.close()
        if dist.is_initialized():
            dist.barrier()
        raise TrainingStopped(message, exit_code=0)

    def exit_reason(self) -> Optional[str]:
        t, state = self.cfg.training, self.state
        if t.exit_interval and state.iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        flags = torch.zeros(2)
        if t.exit_duration_in_mins is not None:
            flags[0] = float((time.time() - state.start_time) / 60.0 > t.exit_duration_in_mins)
        if self.signal_handler is not None:
            flags[1] = float(self.signal_handler.received())
        if t.exit_duration_in_mins is None and self.signal_handler is None:
            return None
        if dist.is_initialized():
            flags = flags.to(get_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            flags = flags.cpu()
        if flags[0] > 0:
            return f"--exit-duration-in-mins {t.exit_duration_in_mins}"
        if flags[1] > 0:
            return "received SIGTERM (--exit-signal-handler)"
        return None

    def save(self, root: Optional[str] = None) -> None:
        """Save (collective) to ``root`` (default ``--save``); with --async-save the time shown is what
        training waited for: the previous background save, staging and the RNG files.  A non-persistent
        root keeps only its newest complete checkpoint."""
        state, c = self.state, self.cfg.checkpoint
        root = root or c.save
        self.timers("save-checkpoint").start(barrier=True)
        self.complete_async_save()
        save_checkpoint_states(
            root,
            state.iteration,
            self.checkpoint_states,  # model and optimizer, scheduler, data position, RNG and the features' state
            self.groups,
            config=self.cfg.to_dict(),
            async_writer=self.async_writer,
            ckpt_format=c.ckpt_format,
        )
        if root != c.save and (not dist.is_initialized() or dist.get_rank() == 0):
            remove_older_checkpoints(root)
        self.timers("save-checkpoint").stop(barrier=True)
        how = "started saving" if self.async_writer is not None else "saved"
        logger.info(
            f"{how} checkpoint at iteration {state.iteration} to {root}"
            + (" in the background" if self.async_writer is not None else "")
        )
        print_timing(self.timers.log(["save-checkpoint"]))  # collective

    def complete_async_save(self) -> None:
        """Wait for the background save in flight (--async-save); collective, so that a write
        that failed on any rank stops every rank with its message."""
        if self.async_writer is None:
            return
        message, iteration = "", None
        try:
            iteration = self.async_writer.wait()
        except AsyncSaveError as e:
            message = str(e)
        failed = torch.tensor([1.0 if message else 0.0], device=get_device())
        if dist.is_initialized():
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() > 0:
            raise CheckpointSaveFailed(message or "a background checkpoint save failed on another rank")
        if iteration is not None:
            logger.info(f"finished saving checkpoint at iteration {iteration} in the background")

    # -- logging and evaluation --

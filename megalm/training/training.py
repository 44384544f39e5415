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
:mod:`megalm.log`.  Building the model chunks lives in :mod:`megalm.training.build`, the
log-line bookkeeping (:class:`IntervalStats`, the reporting rank) in :mod:`megalm.training.log_interval`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.checkpoint.async_writer import AsyncCheckpointWriter, AsyncSaveError
from megalm.checkpoint.common_json import layout
from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.load import load_checkpoint, load_rng_state
from megalm.checkpoint.model_state import finish_param_sync
from megalm.checkpoint.resume import checkpoint_to_resume, newest_load_root, non_persistent_dir, read_tracker
from megalm.checkpoint.rng import set_rng_state
from megalm.checkpoint.save import check_save_dir, remove_older_checkpoints, save_checkpoint
from megalm.checkpoint.stateful import CheckpointStates
from megalm.config import MegalmConfig, parse_config, with_vocab_size
from megalm.config.validation import step_schedule
from megalm.device import get_device
from megalm.distributed.collective_errors import named_collective_failures
from megalm.distributed.local_sgd import build_outer_sync
from megalm.errors import MegalmError, TrainingStopped
from megalm.fusions import BackendUnavailable, compile_stats, plan_fusions
from megalm.log import get_logger
from megalm.pipeline_parallel import get_forward_backward_func
from megalm.pipeline_parallel.reporting import losses_to_floats
from megalm.timers import ITERATION_TIMERS, SETUP_TIMERS, Timers
from megalm.topology import run_topology_report
from megalm.training.build import build_model_chunks, count_parameters, wrap_data_parallel
from megalm.training.initialize import initialize_megalm, world_size_from_env
from megalm.training.local_checkpoint import build_local_checkpoint, describe_save
from megalm.training.log_interval import IntervalStats, is_logging_rank, print_timing
from megalm.training.loss_checks import NumericsChecks, NumericsStop
from megalm.training.microbatches import MicrobatchCalculator
from megalm.training.profiling import ProfilerUnavailable, StepProfiler, check_profiler_available
from megalm.training.signals import ExitSignalHandler
from megalm.training.step import StepResult, TrainState, evaluate, train_step

logger = get_logger(__name__)

__all__ = ["Trainer", "TrainState", "TrainingSetupError", "CheckpointSaveFailed", "pretrain"]


class TrainingSetupError(MegalmError):
    """The run cannot start: missing flags or data, an unusable checkpoint, backend or logger."""


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
    if extra_validation is not None:
        extra_validation(cfg)
    run = Trainer(cfg, model_provider, forward_step_func)
    # A collective's timeout or lost peer, anywhere in the run, becomes an error naming its group.
    with named_collective_failures(lambda: run.groups, cfg.parallel.distributed_timeout_minutes * 60):
        return run.run()


class Trainer:
    """Holds what one run builds; ``run()`` trains.  Kept small: each step is a method."""

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
        self.rebalancer = None  # --straggler-rebalance-interval: built in setup()
        self.checkpoint_states = CheckpointStates()  # what components register with the checkpointer, in setup()
        self.local_checkpoint = None  # --non-persistent-ckpt-type local: built in setup()
        self.rng_tracker = None  # the rank's seeded RNG tracker (model chunks, checkpoints), from setup()

    # -- set-up --
    def setup(self) -> None:
        from megalm.optimizer import build_optimizer
        from megalm.training.lr_scheduler import OptimizerParamScheduler
        from megalm.training.metrics import MetricsWriter

        cfg = self.cfg
        self._check_before_start()
        self.rng_tracker = initialize_megalm(cfg)  # seeded; the model chunks and the checkpoint take it
        self.groups = parallel_state.get_process_groups()  # the entry point: built once here, passed down
        # fail early if the layout's schedule is not available
        get_forward_backward_func(self.groups, cfg.parallel.virtual_pipeline_model_parallel_size)
        self.timers = Timers.from_config(cfg.logging)
        self.stragglers = self._straggler_report()  # collective with --log-straggler
        self.profiler = StepProfiler(cfg.logging, dist.get_rank())
        self.async_writer = AsyncCheckpointWriter() if cfg.checkpoint.async_save else None
        self.tokenizer = self._build_tokenizer()
        cfg = self.cfg  # with the tokenizer's vocabulary size
        self.timers("model-and-optimizer-setup").start()
        chunks = build_model_chunks(cfg, self.model_provider, self.groups, self.rng_tracker)
        self.model = wrap_data_parallel(cfg, chunks, self.groups)
        self.optimizer = build_optimizer(cfg, self.model, process_groups=self.groups)
        self.scheduler = OptimizerParamScheduler.from_config(cfg, self.optimizer)
        self.numerics = NumericsChecks(cfg.training, self.optimizer.grad_scaler, self.groups)
        t = cfg.training
        self.microbatches = self._microbatch_calculator()
        self.train_iters = self._train_iters()
        # After train_iters is known (counted here under --train-samples; the config is not changed).
        self.outer_sync = build_outer_sync(cfg, self.optimizer, self.groups, last_iteration=self.train_iters)
        self.checkpoint_states = self._checkpoint_states()
        self._validate_data()  # before any output (metrics file, checkpoints) is created
        # Before the RNG state is restored: the CPU peak measurement draws random matrices.
        self.peak_flops, self.peak_source = self._device_peak()
        self.local_checkpoint = build_local_checkpoint(cfg.checkpoint)  # collective
        loaded = self._restore_local() or (self._load() if self.resume else None)
        self.microbatches.update(self.state.consumed_train_samples)
        self.rebalancer = self._straggler_rebalancer()
        self.timers("model-and-optimizer-setup").stop()
        self.metrics = MetricsWriter(cfg, enabled=is_logging_rank(self.groups))
        with self.timers("train/valid/test-data-iterators-setup"):
            self._build_data()
        if loaded is not None and not (cfg.checkpoint.no_load_rng or cfg.checkpoint.finetune):
            # Last: building data loaders draws from the torch RNG.
            if "rng" in loaded:  # a local checkpoint's
                set_rng_state(loaded["rng"], self.rng_tracker)
            else:
                load_rng_state(loaded["path"], loaded, self.rng_tracker)
        self.signal_handler = ExitSignalHandler() if t.exit_signal_handler else None
        self.memory_reported = False
        self.compile_reported = compile_stats()
        plan = getattr(chunks[0], "fusion_plan", None)
        if plan is not None:
            logger.info(f"fusions: {plan.describe()}")
        n_params = count_parameters(chunks)
        dp = parallel_state.group_size(self.groups.dp)
        logger.info(
            f"world {dist.get_world_size()} | tp {cfg.parallel.tensor_model_parallel_size} "
            f"pp {cfg.parallel.pipeline_model_parallel_size} dp {dp} "
            f"| parameters on rank 0: {n_params:,} | train iters {self.train_iters}"
        )
        logger.info(run_topology_report(cfg.parallel, dist.get_world_size()))
        print_timing(self.timers.log(SETUP_TIMERS))  # collective

    def _straggler_report(self):
        """--log-straggler's :class:`megalm.training.stragglers.StragglerReport` (collective), else None."""
        if not self.cfg.logging.log_straggler:
            return None
        from megalm.distributed.comm import ranks_per_node
        from megalm.training.stragglers import StragglerReport

        return StragglerReport(self.cfg.logging, ranks_per_node())

    def _device_peak(self):
        from megalm.flops import cpu_has_native_half, device_peak_flops

        t = self.cfg.training
        dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
        if get_device().type == "cpu" and not cpu_has_native_half(dtype):
            flag = "--bf16" if t.bf16 else "--fp16"
            logger.warning(
                f"this CPU has no native {flag[2:]} matrix instructions (oneDNN reports "
                f"none): {flag} matmuls run orders of magnitude slower than fp32 here; drop {flag} to train "
                f"in fp32"
            )
        peak, source = device_peak_flops(dtype, self.cfg.logging.device_peak_flops, get_device())
        logger.info(f"device peak for MFU: {peak / 1e12:.3f} TFLOP/s per rank ({source})")
        return peak, source

    def _check_before_start(self) -> None:
        cfg = self.cfg
        if cfg.training.train_iters is None and cfg.training.train_samples is None and not cfg.training.skip_train:
            raise TrainingSetupError("give --train-iters or --train-samples")
        d = cfg.data
        if not (d.mock_data or d.data_path or d.train_data_path):
            raise TrainingSetupError("no training data: give --data-path PREFIX (or --train-data-path, or --mock-data)")
        c = cfg.checkpoint
        if c.save:
            check_save_dir(c.save)  # a non-directory or unwritable --save fails before any work
        self.load_root = c.load
        if c.load and c.ckpt_step is None:  # a newer non-persistent checkpoint wins
            self.load_root = newest_load_root(c.load, non_persistent_dir(c, c.load))
        try:
            self.resume = bool(c.load) and checkpoint_to_resume(
                self.load_root,
                c.save if self.load_root == c.load else self.load_root,
                c.ckpt_step,
                c.exit_on_missing_checkpoint,
                fallback=c.ckpt_fallback_to_verified,
            )
        except CheckpointError as e:
            raise TrainingSetupError(str(e)) from None
        if c.load and not self.resume:
            logger.warning(
                f"no checkpoint in --load {c.load} yet: training starts from scratch "
                f"(--exit-on-missing-checkpoint makes this an error)"
            )
        try:
            plan_fusions(cfg.model, half_precision=cfg.training.bf16 or cfg.training.fp16)
        except BackendUnavailable as e:
            raise TrainingSetupError(str(e)) from None
        try:
            check_profiler_available(cfg.logging)  # on every rank, not only the profiled ones
        except ProfilerUnavailable as e:
            raise TrainingSetupError(str(e)) from None
        from megalm.training.metrics import WandbSetupError, check_wandb_ready

        try:
            check_wandb_ready(cfg.logging)  # on every rank, before any work
        except WandbSetupError as e:
            raise TrainingSetupError(str(e)) from None

    def _build_tokenizer(self):
        from megalm.tokenizers import build_tokenizer

        cfg, data_fields = self.cfg, {}
        if cfg.data.tokenizer_type is None:
            if cfg.model.vocab_size is None:
                raise TrainingSetupError(
                    "give --tokenizer-type (and --tokenizer-model), or --vocab-size for --mock-data"
                )
            data_fields["tokenizer_type"] = "NullTokenizer"
        tokenizer = build_tokenizer(dataclasses.replace(cfg.data, **data_fields), cfg.model)
        # The validated config is frozen: the run goes on with a copy holding the tokenizer's vocabulary.
        self.cfg = with_vocab_size(cfg, tokenizer.vocab_size, **data_fields)
        return tokenizer

    def _microbatch_calculator(self) -> MicrobatchCalculator:
        """The global batch of each iteration: constant, ``--rampup-batch-size`` or ``--step-batch-size-schedule``."""
        t = self.cfg.training
        return MicrobatchCalculator(
            t.global_batch_size,
            t.micro_batch_size,
            parallel_state.group_size(self.groups.dp),
            t.rampup_batch_size,
            step_schedule(t, self.cfg.model.seq_length),
        )

    def _train_iters(self) -> int:
        t = self.cfg.training
        if t.train_iters is not None:
            return t.train_iters
        if t.train_samples is None:
            return 0
        # Walk the ramp-up (or step schedule) to count iterations.
        calc = self._microbatch_calculator()
        iters, consumed = 0, 0
        while consumed < t.train_samples:
            calc.update(consumed)
            consumed += calc.current_global_batch_size
            iters += 1
        return iters

    def _validate_data(self) -> None:
        """Every data prefix exists, is intact and holds only ids below the vocabulary (collective)."""
        from megalm.data.builder import get_train_valid_test_num_samples, validate_data

        validate_data(self.cfg, self.tokenizer, get_train_valid_test_num_samples(self.cfg, self.train_iters))

    def _build_data(self) -> None:
        from megalm.data import build_train_valid_test_data_iterators

        cfg = self.cfg
        iterators = build_train_valid_test_data_iterators(
            cfg,
            self.tokenizer,
            self.state.consumed_train_samples,
            self.state.consumed_valid_samples,
            groups=self.groups,
            train_iters=self.train_iters,
            train_shares=self.rebalancer.shares if self.rebalancer is not None else None,
        )
        self.data_iterators = iterators
        self.train_iter, self.valid_iter, self.test_iter = iterators
        _, has_valid, has_test = iterators.splits  # the same answer on every rank
        self.do_valid = cfg.training.eval_iters > 0 and has_valid
        self.do_test = cfg.training.eval_iters > 0 and has_test

    def _checkpoint_states(self) -> CheckpointStates:
        """The states this trainer's components register with the checkpointer (besides the model,
        optimizer, scheduler and RNG, which every checkpoint has): see :mod:`megalm.checkpoint.stateful`."""
        from megalm.distributed.compression.checkpoint_state import CompressionCheckpointState

        states = CheckpointStates()
        if self.cfg.parallel.grad_compression != "none":
            states.register("grad_compression", CompressionCheckpointState(self.model, self.groups, layout()))
        if self.outer_sync is not None:
            states.register("local_sgd", self.outer_sync)  # each replica's weights, optimizer and the outer state
        return states

    def _load(self) -> None:
        c = self.cfg.checkpoint
        # --no-load-optim / --finetune: the replicas restart from the loaded weights (reset below)
        states = (
            self.checkpoint_states.without("local_sgd") if c.finetune or c.no_load_optim else self.checkpoint_states
        )
        try:
            common = load_checkpoint(
                self.load_root,
                self.model,
                self.optimizer,
                self.scheduler,
                load_optim=not c.no_load_optim,
                load_rng=False,
                finetune=c.finetune,
                iteration=c.ckpt_step,
                fallback=c.ckpt_fallback_to_verified,
                states=states,
            )
        except CheckpointError as e:
            raise TrainingSetupError(str(e)) from None
        if self.outer_sync is not None and "local_sgd" not in states:
            self.outer_sync.reset()
        self.state.iteration = common["iteration"]
        self.state.consumed_train_samples = common["consumed_train_samples"]
        self.state.consumed_valid_samples = common["consumed_valid_samples"]
        logger.info(f"loaded checkpoint from {self.load_root} at iteration {self.state.iteration}")
        return common

    def _restore_local(self) -> Optional[dict]:
        """The newest local checkpoint (:mod:`megalm.checkpoint.local`) when it is at least as new as
        the disk checkpoint to resume from; None otherwise (also with --finetune, --no-load-optim or
        --ckpt-step, which name what to load).  Collective."""
        c, local = self.cfg.checkpoint, self.local_checkpoint
        if local is None or c.finetune or c.no_load_optim or c.ckpt_step is not None:
            return None
        disk = read_tracker(self.load_root) if self.resume else None
        try:
            common = local.restore(
                self.model, self.optimizer, self.scheduler, self.cfg.to_dict(), disk, self.checkpoint_states
            )
        except CheckpointError as e:
            raise TrainingSetupError(str(e)) from None
        if common is not None:
            self.state.iteration = common["iteration"]
            self.state.consumed_train_samples = common["consumed_train_samples"]
            self.state.consumed_valid_samples = common["consumed_valid_samples"]
        return common

    def save_local(self) -> None:
        """A local checkpoint of this iteration (collective)."""
        state = self.state
        outcome = self.local_checkpoint.save(
            state.iteration,
            self.model,
            self.optimizer,
            self.scheduler,
            state.consumed_train_samples,
            state.consumed_valid_samples,
            self.cfg.to_dict(),
            self.checkpoint_states,
            self.rng_tracker,
        )
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

    def _hang_watchdog(self):
        """--hang-watchdog-seconds' :class:`megalm.training.hang_watchdog.HangWatchdog`, else None."""
        t, c = self.cfg.training, self.cfg.checkpoint
        if not t.hang_watchdog_seconds:
            return None
        from megalm.training.hang_watchdog import HangWatchdog

        directory = t.hang_watchdog_dir or (os.path.join(c.save, "hang_stacks") if c.save else None)
        return HangWatchdog(t.hang_watchdog_seconds, dist.get_rank() if dist.is_initialized() else 0, directory)

    def _straggler_rebalancer(self):
        """--straggler-rebalance-interval's :class:`megalm.training.rebalance.StragglerRebalancer`, else None."""
        n = self.cfg.training.straggler_rebalance_interval
        if not n:
            return None
        from megalm.training.rebalance import StragglerRebalancer

        dp = self.groups.dp
        rank, size = (dist.get_rank(dp), dist.get_world_size(dp)) if dp is not None else (0, 1)
        return StragglerRebalancer(n, self.microbatches.num_microbatches, rank, size)

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

    def _first_step_deadline(self):
        """--first-step-timeout-seconds' :class:`megalm.training.first_step.FirstStepDeadline` (with
        more than one rank), else None."""
        seconds = self.cfg.training.first_step_timeout_seconds
        if not seconds or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        from megalm.training.first_step import FirstStepDeadline, job_store

        return FirstStepDeadline(seconds, job_store(), dist.get_rank(), dist.get_world_size())

    def _first_step_watched(self, deadline) -> None:
        """The first iteration, telling ``deadline`` when this rank has read its first batch (at
        once on ranks that read none) and when the step is done."""
        from megalm.training.first_step import STAGES

        train_iter = self.train_iter
        if train_iter is None:
            deadline.reached(STAGES[1])
        else:

            def first_batch_marked():
                for batch in train_iter:
                    deadline.reached(STAGES[1])
                    yield batch
                    break
                yield from train_iter

            self.train_iter = first_batch_marked()
        try:
            self.train_iteration()
        finally:
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
        result = train_step(
            cfg,
            self.forward_step_func,
            self.train_iter,
            self.model,
            self.optimizer,
            self.scheduler,
            state,
            self.microbatches,
            self.groups,
            self.timers,
            self.outer_sync,
            self.rebalancer,
        )
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
        save_checkpoint(
            root,
            state.iteration,
            self.model,
            None if c.no_save_optim else self.optimizer,
            None if c.no_save_optim else self.scheduler,
            state.consumed_train_samples,
            state.consumed_valid_samples,
            config=self.cfg.to_dict(),
            async_writer=self.async_writer,
            save_rng=not c.no_save_rng,
            states=self.checkpoint_states,
            rng_tracker=self.rng_tracker,
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
    def log_training(self, log: "IntervalStats") -> None:
        from megalm.distributed.comm import inter_node_bytes_per_node
        from megalm.training.metrics import format_log_line
        from megalm.training.stragglers import format_stragglers, stragglers_record

        cfg, state = self.cfg, self.state
        means = log.means(self.groups)  # one device-to-host copy per log line
        record = {
            "iteration": state.iteration,
            "consumed_samples": state.consumed_train_samples,
            "lm_loss": means.get("lm loss"),
            "grad_norm": log.last_grad_norm,
            "lr": self.scheduler.get_lr(),
            "loss_scale": self.optimizer.get_loss_scale(),
            **log.throughput(cfg, self.peak_flops),
            "global_batch_size": self.microbatches.current_global_batch_size,
            "skipped_iterations": log.skipped,
            "nan_iterations": log.nans,
        }
        if log.last_num_zeros is not None:  # --log-num-zeros-in-grad: "number of zeros" (Megatron)
            record["num_zeros"] = log.last_num_zeros
        for key, value in means.items():
            if key != "lm loss":
                record[key.replace(" ", "_")] = value
        if cfg.logging.log_params_norm:
            record["params_norm"] = self.params_norm()
        record.update(self._new_compilations())
        nodes = inter_node_bytes_per_node()  # collective over the world with several nodes
        if len(nodes) > 1:  # the busiest node's bytes over inter-node links per iteration
            record["inter_node_bytes"] = max(nodes) / max(log.iterations, 1)
        line = format_log_line(record, self.train_iters)
        if self.stragglers is not None:  # collective over the world
            stragglers = self.stragglers.gather(log.time, log.iterations, self.timers)
            if stragglers is not None:
                line += format_stragglers(stragglers)
                record.update(stragglers_record(stragglers))
        if is_logging_rank(self.groups):
            logger.info(line, extra={"on_rank": None})
        record.update(self._log_timers(log.iterations))
        record.update(self._writer_only_scalars())
        self.metrics.log_iteration(record)
        if cfg.logging.log_memory and not self.memory_reported:
            self.report_memory()

    def _writes_iteration_scalars(self, iteration: int) -> bool:
        """``--tensorboard-log-interval``: the same answer on every rank (the losses' exchange is collective)."""
        lg = self.cfg.logging
        every = lg.tensorboard_log_interval
        return bool(every and iteration % every == 0 and (lg.tensorboard_dir or lg.wandb_project))

    def log_iteration_scalars(self, result: StepResult) -> None:
        """This iteration's values to TensorBoard / W&B (Megatron's per-iteration TensorBoard scalars)."""
        losses = losses_to_floats(result.losses, self.groups)  # collective over the pipeline group
        self.metrics.log_scalars(
            self.state.iteration,
            {
                "lm_loss": losses.get("lm loss"),
                "lr": self.scheduler.get_lr(),
                "loss_scale": self.optimizer.get_loss_scale(),
                "grad_norm": result.grad_norm,
                "global_batch_size": result.global_batch_size,
            },
        )

    def _writer_only_scalars(self) -> dict:
        """--log-memory-to-tensorboard / --log-world-size-to-tensorboard (not in the console line)."""
        from megalm.training.memory import memory_scalars

        lg, values = self.cfg.logging, {}
        if lg.log_memory_to_tensorboard:
            values.update(memory_scalars(get_device()))
        if lg.log_world_size_to_tensorboard:
            values["world-size"] = dist.get_world_size() if dist.is_initialized() else 1
        return values

    def _log_timers(self, iterations: int) -> dict:
        """The interval's per-phase timing block (collective; nothing at --timing-log-level 0);
        returns ``{"<name>-time": seconds}`` with --log-timers-to-tensorboard."""
        if self.timers.log_level == 0:
            return {}
        block, slowest = self.timers.report(ITERATION_TIMERS, iterations)
        print_timing(block)
        return slowest if self.cfg.logging.log_timers_to_tensorboard else {}

    def params_norm(self) -> float:
        """--log-params-norm: the distributed optimizer's pending parameter all-gathers are
        finished first (they would otherwise wait for the next forward)."""
        from megalm.optimizer.clip_grads import params_norm

        finish_param_sync(self.model)
        return params_norm([p for chunk in self.model for p in chunk.parameters()], self.groups)

    def _new_compilations(self) -> dict:
        """Fused graphs compiled since the last log line (all in the first interval when shapes
        are fixed; later ones are recompilations): logged, and returned for the metrics record."""
        stats, last = compile_stats(), self.compile_reported
        self.compile_reported = stats
        if stats.graphs == last.graphs:
            return {}
        graphs, seconds = stats.graphs - last.graphs, stats.seconds - last.seconds
        logger.info(
            f"torch.compile: {graphs} fused graph(s) compiled in {seconds:.1f} s since the last "
            f"log line (first iteration, or a new shape / no-grad evaluation)"
        )
        return {"compiled_graphs": graphs, "compile_seconds": seconds}

    def report_memory(self) -> None:
        """Peak memory of every rank, once, at the first log line (collective)."""
        from megalm.training.memory import gather_peak_memory, peak_memory

        self.memory_reported = True
        peaks = gather_peak_memory()
        kind = "max allocated" if peak_memory(get_device())["kind"] == "cuda" else "peak RSS"
        logger.info(
            f"memory per rank ({kind}, MB): " + ", ".join(f"rank {r}: {b / 2**20:.0f}" for r, b in enumerate(peaks))
        )

    def evaluate_and_log(self, split: str, data_iterator) -> None:
        t = self.cfg.training
        n_micro = self.microbatches.num_microbatches
        values = evaluate(
            self.cfg, self.forward_step_func, data_iterator, self.model, t.eval_iters, n_micro, self.groups
        )
        self.state.consumed_valid_samples += (
            t.eval_iters * self.microbatches.current_global_batch_size if split == "validation" else 0
        )
        loss = values.get("lm loss")
        if loss is None:
            return
        ppl = math.exp(min(20.0, loss))
        if is_logging_rank(self.groups):
            bar = "-" * 90
            logger.info(
                f"{bar}\n {split} loss at iteration {self.state.iteration} | lm loss value: {loss:.6E} | "
                f"lm loss PPL: {ppl:.6E} |\n{bar}",
                extra={"on_rank": None},
            )
        self.metrics.log_evaluation(self.state.iteration, split, loss, ppl)

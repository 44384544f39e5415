"""The :class:`~megalm.training.training.Trainer`'s set-up: what one run builds before its first
iteration, in order (:meth:`TrainerSetup.setup`): the checks that need no work (flags, data, ``--save``,
the checkpoint to resume), process groups and the RNG tracker (:func:`megalm.training.initialize.initialize_megalm`),
tokenizer, model chunks, optimizer and scheduler, the states registered with the checkpointer, the
checkpoint load, data iterators, and the optional watchers (straggler report, hang watchdog, first-step
deadline, rebalancer).  Collective where it says so.  A mixin of the Trainer: the methods read and set
the trainer's attributes (``self.cfg``, ``self.groups``, ...), listed in ``Trainer.__init__``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.checkpoint.async_writer import AsyncCheckpointWriter
from megalm.checkpoint.common_json import layout
from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.load import load_checkpoint_states, load_states
from megalm.checkpoint.model_state import ModelOptimizerState
from megalm.checkpoint.resume import checkpoint_to_resume, newest_load_root, non_persistent_dir, read_tracker
from megalm.checkpoint.save import check_save_dir
from megalm.checkpoint.stateful import CheckpointStates
from megalm.config import with_vocab_size
from megalm.config.validation import step_schedule
from megalm.device import get_device
from megalm.distributed.comm import CommStats
from megalm.distributed.local_sgd import build_outer_sync
from megalm.errors import MegalmError
from megalm.fusions import BackendUnavailable, compile_stats, plan_fusions
from megalm.log import get_logger
from megalm.pipeline_parallel import get_forward_backward_func
from megalm.timers import SETUP_TIMERS, Timers
from megalm.topology import run_topology_report
from megalm.training.build import build_model_chunks, count_parameters, wrap_data_parallel
from megalm.training.initialize import initialize_megalm
from megalm.training.local_checkpoint import build_local_checkpoint
from megalm.training.log_interval import is_logging_rank, print_timing
from megalm.training.loss_checks import NumericsChecks
from megalm.training.microbatches import MicrobatchCalculator
from megalm.training.profiling import ProfilerUnavailable, StepProfiler, check_profiler_available
from megalm.training.signals import ExitSignalHandler

logger = get_logger(__name__)


class TrainingSetupError(MegalmError):
    """The run cannot start: missing flags or data, an unusable checkpoint, backend or logger."""


class TrainerSetup:
    """The set-up half of :class:`~megalm.training.training.Trainer` (see the module docstring)."""

    def setup(self) -> None:
        from megalm.optimizer import build_optimizer
        from megalm.training.lr_scheduler import OptimizerParamScheduler
        from megalm.training.metrics import MetricsWriter

        cfg = self.cfg
        self._check_before_start()
        self.rng_tracker = initialize_megalm(cfg)  # seeded; the model chunks and the checkpoint take it
        self.groups = parallel_state.get_process_groups()  # the entry point: built once here, passed down
        self.replicas = self._join_replica_groups()  # early: other groups wait for one still setting up
        # fail early if the layout's schedule is not available
        get_forward_backward_func(self.groups, cfg.parallel.virtual_pipeline_model_parallel_size)
        self.timers = Timers.from_config(cfg.logging)
        self.stragglers = self._straggler_report()  # collective with --log-straggler
        self.profiler = StepProfiler(cfg.logging, dist.get_rank())
        # --async-save writes over a gloo group of its own, built here
        io_group = parallel_state.get_checkpoint_io_group() if cfg.checkpoint.async_save else None
        self.async_writer = AsyncCheckpointWriter(io_group) if cfg.checkpoint.async_save else None
        self.tokenizer = self._build_tokenizer()
        cfg = self.cfg  # with the tokenizer's vocabulary size
        self.timers("model-and-optimizer-setup").start()
        chunks = build_model_chunks(cfg, self.model_provider, self.groups, self.rng_tracker)
        # counts what DDP, the optimizer, the step and local SGD communicate; the layout's nodes decide inter-node bytes
        self.comm_stats = CommStats(parallel_state.get_ranks_per_node())
        self.model = wrap_data_parallel(cfg, chunks, self.groups, self.comm_stats)
        self.optimizer = build_optimizer(cfg, self.model, process_groups=self.groups, comm_stats=self.comm_stats)
        self.scheduler = OptimizerParamScheduler.from_config(cfg, self.optimizer)
        self.numerics = NumericsChecks(cfg.training, self.optimizer.grad_scaler, self.groups)
        t = cfg.training
        self.microbatches = self._microbatch_calculator()
        self.train_iters = self._train_iters()
        # After train_iters is known (counted here under --train-samples; the config is not changed).
        self.outer_sync = build_outer_sync(
            cfg,
            self.optimizer,
            self.groups,
            last_iteration=self.train_iters,
            comm_stats=self.comm_stats,
            replicas=self.replicas.outer if self.replicas is not None else None,
        )
        self.checkpoint_states = self._checkpoint_states()
        self.local_checkpoint_states = self._checkpoint_states(local=True)
        self._validate_data()  # before any output (metrics file, checkpoints) is created
        # Before the RNG state is restored: the CPU peak measurement draws random matrices.
        self.peak_flops, self.peak_source = self._device_peak()
        self.local_checkpoint = build_local_checkpoint(cfg.checkpoint)  # collective
        loaded = self._restore_local() or (self._load() if self.resume else None)
        self.offload_io_logged = self.optimizer.offload_io_bytes()  # swap bytes at the last log line
        self.microbatches.update(self.state.consumed_train_samples)
        self.rebalancer = self._straggler_rebalancer()
        self.timers("model-and-optimizer-setup").stop()
        self.metrics = MetricsWriter(cfg, enabled=is_logging_rank(self.groups))
        with self.timers("train/valid/test-data-iterators-setup"):
            self._build_data()
        if loaded is not None and not (cfg.checkpoint.no_load_rng or cfg.checkpoint.finetune):
            # Last: building data loaders draws from the torch RNG.
            only_rng = CheckpointStates()
            only_rng.register("rng", self.checkpoint_states.get("rng"))
            # from rng/rank_*.pt, or from the state dicts a local checkpoint holds in memory ("held")
            load_states(loaded["path"], loaded, self.groups, only_rng, held=loaded.get("held"))
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
        if self.replicas is not None:
            self.replicas.attach(self.model, self.optimizer, self.scheduler, self.microbatches, self.outer_sync)
            if self.state.iteration:  # resumed from a checkpoint: torchft's step follows
                self.replicas.resume_at(self.state.iteration)

    def _join_replica_groups(self):
        """--ft-replica-group-id: torchft's manager of this rank, heartbeating to the lighthouse
        (:mod:`megalm.resilience.torchft_replicas`), else None."""
        from megalm.resilience.torchft_replicas import build_replica_groups

        return build_replica_groups(self.cfg, self.groups, self.state)

    def _straggler_report(self):
        """--log-straggler's :class:`megalm.training.stragglers.StragglerReport` (collective), else None."""
        if not self.cfg.logging.log_straggler:
            return None
        from megalm.distributed.comm import ranks_per_node
        from megalm.training.stragglers import StragglerReport

        return StragglerReport(self.cfg.logging, ranks_per_node(parallel_state.get_ranks_per_node()))

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
        if cfg.parallel.ft_replica_group_id is not None:
            from megalm.resilience.torchft_replicas import require_torchft

            require_torchft()  # the [ft] extra, before any work

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
        from megalm.resilience.torchft_replicas import full_quorum_shares

        cfg = self.cfg
        if self.rebalancer is not None:
            shares = self.rebalancer.shares
        else:  # None without torchft
            shares = full_quorum_shares(cfg, parallel_state.group_size(self.groups.dp))
        iterators = build_train_valid_test_data_iterators(
            cfg,
            self.tokenizer,
            self.state.consumed_train_samples,
            self.state.consumed_valid_samples,
            groups=self.groups,
            train_iters=self.train_iters,
            train_shares=shares,
        )
        self.data_iterators = iterators
        self.train_iter, self.valid_iter, self.test_iter = iterators
        _, has_valid, has_test = iterators.splits  # the same answer on every rank
        self.do_valid = cfg.training.eval_iters > 0 and has_valid
        self.do_test = cfg.training.eval_iters > 0 and has_test

    def _checkpoint_states(self, local: bool = False) -> CheckpointStates:
        """The states this trainer registers with the checkpointer: the model and optimizer first (DCP
        tensors, ``optimizer_common``), the LR scheduler and data position (``common.json``), its
        components' (gradient compression, local SGD) and the RNG (``rng/``); see
        :mod:`megalm.checkpoint.stateful`.  ``local``: the same components for a local checkpoint, which
        keeps everything (--no-save-optim and --no-save-rng are about the disk checkpoints a run leaves; a
        local one resumes this same job after a failure, as if uninterrupted)."""
        from megalm.checkpoint.rng import RNGState
        from megalm.distributed.compression.checkpoint_state import CompressionCheckpointState
        from megalm.training.checkpoint_states import DataPosition, SchedulerState

        c = self.cfg.checkpoint
        states = CheckpointStates()
        load_optim = not (c.no_load_optim or c.finetune)  # --finetune / --no-load-optim: the weights only
        save_optim, save_rng = local or not c.no_save_optim, local or not c.no_save_rng
        model = ModelOptimizerState(self.model, self.optimizer, self.groups, save_optim, load_optim)
        states.register("model", model)  # first: the optimizer is restored before the states that read it
        states.register("scheduler", SchedulerState(self.scheduler, save=save_optim))
        states.register("data", DataPosition(self.state))
        if self.cfg.parallel.ft_replica_group_id is not None and self.cfg.parallel.grad_compression != "none":
            states.register("ft_grad_compression", self.replicas.compressor)  # torchft: the groups' average
        elif self.cfg.parallel.grad_compression != "none":
            states.register(
                "grad_compression", CompressionCheckpointState(self.model, self.groups, layout(self.groups))
            )
        if self.outer_sync is not None:
            states.register("local_sgd", self.outer_sync)  # each replica's weights, optimizer and the outer state
        states.register("rng", RNGState(self.rng_tracker, save=save_rng))  # restored last (setup)
        return states

    def _load(self) -> None:
        c = self.cfg.checkpoint
        # the RNG is restored last, in setup(); --no-load-optim / --finetune: no scheduler, and the
        # replicas restart from the loaded weights (reset below)
        states = self.checkpoint_states.without("rng")
        if c.finetune:  # the weights only
            states = states.without(*(name for name, _ in states.items() if name != "model"))
        elif c.no_load_optim:
            states = states.without("scheduler", "local_sgd")
        try:
            common = load_checkpoint_states(
                self.load_root,
                states,
                self.groups,
                iteration=c.ckpt_step,
                fallback=c.ckpt_fallback_to_verified,
                ckpt_format=c.ckpt_format,
                auto_detect=c.auto_detect_ckpt_format,
            )
        except CheckpointError as e:
            raise TrainingSetupError(str(e)) from None
        if c.finetune:
            common = dict(common, iteration=0, consumed_train_samples=0, consumed_valid_samples=0)
        if self.outer_sync is not None and "local_sgd" not in states:
            self.outer_sync.reset()
        self.state.iteration = common["iteration"]  # the consumed samples: restored by the "data" state
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
            # the RNG is set last, in setup(), from what the restore returns ("held")
            states = self.local_checkpoint_states.without("rng")
            common = local.restore(self.cfg.to_dict(), disk, states, self.groups)
        except CheckpointError as e:
            raise TrainingSetupError(str(e)) from None
        if common is not None:  # the consumed samples: restored by the "data" state
            self.state.iteration = common["iteration"]
        return common

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

    def _first_step_deadline(self):
        """--first-step-timeout-seconds' :class:`megalm.training.first_step.FirstStepDeadline` (with
        more than one rank), else None."""
        seconds = self.cfg.training.first_step_timeout_seconds
        if not seconds or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        from megalm.training.first_step import FirstStepDeadline, job_store

        return FirstStepDeadline(seconds, job_store(), dist.get_rank(), dist.get_world_size())

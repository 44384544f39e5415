"""The :class:`~megalm.training.training.Trainer`'s reporting: the log line of every
``--log-interval`` (losses, throughput and MFU, grad norm, memory, compilations, stragglers,
timers; the same record to the metrics writers), per-iteration TensorBoard / W&B scalars, and
evaluation with its perplexity line.  Collective where it says so.  A mixin of the Trainer: the
methods read the trainer's attributes (``self.cfg``, ``self.state``, ``self.metrics``, ...).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from megalm.checkpoint.model_state import finish_param_sync
from megalm.device import get_device
from megalm.fusions import compile_stats
from megalm.log import get_logger
from megalm.pipeline_parallel.reporting import losses_to_floats
from megalm.timers import ITERATION_TIMERS
from megalm.training.log_interval import IntervalStats, is_logging_rank, print_timing
from megalm.training.step import StepResult, evaluate

logger = get_logger(__name__)


class TrainerReporting:
    """The log-line and evaluation half of :class:`~megalm.training.training.Trainer` (see the module docstring)."""

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
        io = self.optimizer.offload_io_bytes()
        if io != (0, 0):  # --optimizer-offload-device nvme: this rank's swap bytes per iteration
            (read, written), (read0, written0) = io, self.offload_io_logged
            record["swap_read_bytes"] = (read - read0) / max(log.iterations, 1)
            record["swap_written_bytes"] = (written - written0) / max(log.iterations, 1)
            self.offload_io_logged = io
        record.update(self._new_compilations())
        nodes = inter_node_bytes_per_node(self.comm_stats)  # collective over the world with several nodes
        if len(nodes) > 1:  # the busiest node's bytes over inter-node links per iteration
            record["inter_node_bytes"] = max(nodes) / max(log.iterations, 1)
        line = format_log_line(record, self.train_iters)
        if self.replicas is not None:  # torchft: the quorum of the last step
            record.update(self.replicas.metrics())
            line += f" replica groups: {record['ft_replica_groups']} (this is replica {record['ft_replica_rank']}) |"
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
        return params_norm([p for chunk in self.model for p in chunk.parameters()], self.groups, self.comm_stats)

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

"""Training metrics: JSON Lines file, TensorBoard, Weights & Biases, and the console log line.

Only the rank the caller marks ``enabled`` (last pipeline stage, TP rank 0, DP rank 0) writes;
on every other rank each method is a no-op.  Nothing here communicates.

``--metrics-file`` (appended, flushed after every record, floats at full precision)::

    {"iteration": 10, "consumed_samples": 320, "lm_loss": 7.123..., "grad_norm": 1.9...,
     "lr": 0.0001, "loss_scale": 1.0, "tokens_per_sec": ..., "tflops_per_rank": ...,
     "elapsed_ms": ..., <any extra keys>}                          # one per logged iteration
    {"iteration": 10, "split": "validation", "loss": 7.0..., "ppl": 1100.2...}  # one per evaluation

Non-finite floats are written as ``NaN`` / ``Infinity`` (what Python's json reads back).

TensorBoard tags (``--tensorboard-dir``): ``lm loss``, ``lm loss vs samples`` (x = consumed
samples), ``learning-rate``, ``grad-norm``, ``params-norm`` (``--log-params-norm``),
``loss-scale``, ``batch-size``, ``iteration-time-ms``, ``tokens-per-sec``, ``tflops-per-rank``,
other numeric keys by name; evaluations
``lm loss <split>`` and ``lm loss <split> ppl``.

W&B (``--wandb-project``): ``wandb.log(record, step=iteration)``.  Online mode needs
credentials: without ``WANDB_API_KEY`` or a ``~/.netrc`` entry the writer fails at start-up
(:class:`WandbSetupError`) before any network access; ``WANDB_MODE=offline`` logs locally.
"""

from __future__ import annotations

import json
import math
import netrc
import os
from typing import Any, Dict, Iterable, Optional
from urllib.parse import urlparse

from megalm.errors import MegalmError

TB_TAGS = {
    "lm_loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "params_norm": "params-norm",
    "loss_scale": "loss-scale",
    "global_batch_size": "batch-size",
    "elapsed_ms": "iteration-time-ms",
    "tokens_per_sec": "tokens-per-sec",
    "tflops_per_rank": "tflops-per-rank",
    "num_zeros": "num-zeros",
}


class WandbSetupError(MegalmError, RuntimeError):
    """W&B logging was requested but cannot start (missing package or credentials)."""


# --- W&B credentials -------------------------------------------------------------------------


def wandb_mode() -> str:
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    mode = os.environ.get("WANDB_MODE", "online").lower() or "online"
    return "offline" if mode == "dryrun" else mode


def wandb_has_credentials() -> bool:
    """``WANDB_API_KEY`` set, or a netrc entry for the W&B host (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        auth = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def check_wandb_ready(logging_cfg) -> None:
    """Raise :class:`WandbSetupError` now if ``--wandb-project`` cannot work (call at start-up)."""
    if not logging_cfg.wandb_project or wandb_mode() in ("offline", "disabled"):
        return
    if not wandb_has_credentials():
        raise WandbSetupError(
            "--wandb-project is set but no Weights & Biases credentials were found: set WANDB_API_KEY "
            "(or run `wandb login`), or set WANDB_MODE=offline to log locally and `wandb sync` later"
        )


# --- values ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers (full precision); other values unchanged."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- the writer ----------------------------------------------------------------------------------


class MetricsWriter:
    """Writes training and evaluation records to the configured sinks.

    Args:
        cfg: :class:`megalm.config.MegalmConfig`.
        enabled: True on the one rank that writes.
        run_config: dict stored with the W&B run (default ``cfg.to_dict()``).
    """

    def __init__(self, cfg, enabled: bool, run_config: Optional[dict] = None):
        self.cfg = cfg.logging
        self.enabled = bool(enabled)
        self._file = self._tb = self._wandb = None
        if not self.enabled:
            return
        check_wandb_ready(self.cfg)
        if self.cfg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.cfg.metrics_file)), exist_ok=True)
            self._file = open(self.cfg.metrics_file, "a", encoding="utf-8")
        if self.cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=self.cfg.tensorboard_dir)
        if self.cfg.wandb_project:
            if run_config is None and hasattr(cfg, "to_dict"):
                run_config = cfg.to_dict()
            self._wandb = self._start_wandb(run_config)

    def _start_wandb(self, run_config: Optional[dict]):
        try:
            import wandb
        except ImportError as e:
            raise WandbSetupError("--wandb-project needs the `wandb` package: pip install wandb") from e
        kwargs = {"project": self.cfg.wandb_project, "name": self.cfg.wandb_exp_name, "config": run_config}
        if self.cfg.wandb_save_dir:
            os.makedirs(self.cfg.wandb_save_dir, exist_ok=True)
            kwargs["dir"] = self.cfg.wandb_save_dir
        try:
            return wandb.init(**kwargs)
        except Exception as e:  # noqa: BLE001 - name the fix, keep the cause
            raise WandbSetupError(
                f"could not start the W&B run ({type(e).__name__}: {e}); check WANDB_API_KEY or set WANDB_MODE=offline"
            ) from e

    # --- records -------------------------------------------------------------------------------
    def _write_json(self, record: Dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def log_iteration(self, record: Dict[str, Any]) -> None:
        """One training record (must contain ``iteration``)."""
        if not self.enabled:
            return
        record = {k: _plain(v) for k, v in record.items()}
        step = int(record["iteration"])
        self._write_json(record)
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("iteration", "consumed_samples") and _numeric(value):
                    self._tb.add_scalar(TB_TAGS.get(key, key), value, step)
            if _numeric(record.get("lm_loss")) and "consumed_samples" in record:
                self._tb.add_scalar("lm loss vs samples", record["lm_loss"], int(record["consumed_samples"]))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "iteration"}, step=step)

    log_train = log_iteration

    def log_scalars(self, step: int, values: Dict[str, Any]) -> None:
        """Scalars of one iteration to TensorBoard and W&B only (``--tensorboard-log-interval``: between
        log lines; the metrics file keeps one record per log line)."""
        if not self.enabled:
            return
        values = {k: _plain(v) for k, v in values.items() if _numeric(_plain(v))}
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(TB_TAGS.get(key, key), value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def log_evaluation(
        self, iteration: int, split: str, loss: float, ppl: Optional[float] = None, **extra: Any
    ) -> None:
        """One evaluation record; ``ppl`` defaults to ``exp(min(20, loss))`` (Megatron)."""
        if not self.enabled:
            return
        loss = float(_plain(loss))
        ppl = math.exp(min(20.0, loss)) if ppl is None else float(_plain(ppl))
        record = {
            "iteration": int(iteration),
            "split": split,
            "loss": loss,
            "ppl": ppl,
            **{k: _plain(v) for k, v in extra.items()},
        }
        self._write_json(record)
        if self._tb is not None:
            self._tb.add_scalar(f"lm loss {split}", loss, int(iteration))
            self._tb.add_scalar(f"lm loss {split} ppl", ppl, int(iteration))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{split}/lm loss": loss, f"{split}/ppl": ppl}, step=int(iteration))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


# --- console line -------------------------------------------------------------------------------

_LINE_KEYS = {
    "iteration",
    "consumed_samples",
    "elapsed_ms",
    "lr",
    "global_batch_size",
    "lm_loss",
    "loss_scale",
    "grad_norm",
    "params_norm",
    "num_zeros",
    "skipped_iterations",
    "nan_iterations",
    "tokens_per_sec",
    "tflops_per_rank",
    "mfu",
    "compiled_graphs",
    "compile_seconds",
}  # compilation has its own log line


def format_log_line(record: Dict[str, Any], train_iters: int, extra_losses: Optional[Iterable[str]] = None) -> str:
    """Megatron-style line from a training record (the keys :meth:`MetricsWriter.log_iteration` takes).

    ``extra_losses``: further numeric keys printed after ``lm loss`` (default: every numeric key
    not otherwise printed), as ``<key with spaces>: <value %.6E>``.
    """
    r = {k: _plain(v) for k, v in record.items()}
    parts = [
        f" iteration {int(r['iteration']):8d}/{int(train_iters):8d}",
        f"consumed samples: {int(r.get('consumed_samples', 0)):12d}",
        f"elapsed time per iteration (ms): {float(r.get('elapsed_ms', 0.0)):.1f}",
        f"learning rate: {float(r.get('lr', 0.0)):.6E}",
        f"global batch size: {int(r.get('global_batch_size', 0)):5d}",
    ]
    if r.get("lm_loss") is not None:
        parts.append(f"lm loss: {float(r['lm_loss']):.6E}")
    extras = extra_losses if extra_losses is not None else [k for k in r if k not in _LINE_KEYS and _numeric(r[k])]
    parts += [f"{k.replace('_', ' ')}: {float(r[k]):.6E}" for k in extras if r.get(k) is not None]
    parts.append(f"loss scale: {float(r.get('loss_scale', 1.0)):.1f}")
    if r.get("grad_norm") is not None:
        parts.append(f"grad norm: {float(r['grad_norm']):.3f}")
    if r.get("num_zeros") is not None:
        parts.append(f"num zeros: {float(r['num_zeros']):.1f}")
    if r.get("params_norm") is not None:
        parts.append(f"params norm: {float(r['params_norm']):.3f}")
    parts += [
        f"number of skipped iterations: {int(r.get('skipped_iterations', 0)):3d}",
        f"number of nan iterations: {int(r.get('nan_iterations', 0)):3d}",
    ]
    if r.get("tokens_per_sec") is not None:
        parts.append(f"tokens per second: {float(r['tokens_per_sec']):.1f}")
    if r.get("tflops_per_rank") is not None:
        tflops = float(r["tflops_per_rank"])
        parts.append(f"TFLOP/s per rank: {tflops:.1f}" if tflops >= 10 else f"TFLOP/s per rank: {tflops:.3f}")
    if r.get("mfu") is not None:
        parts.append(f"MFU: {100.0 * float(r['mfu']):.1f}%")
    return " | ".join(parts) + " |"

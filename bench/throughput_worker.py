"""Worker side of bench/train_throughput.py: one configuration (implementation, precision,
fusions) per process, built and timed on the parent's command.

The parent (``train_throughput.py``, class ``Worker``) starts ``train_throughput.py --_worker SPEC``,
which runs :func:`worker_main` here: JSON lines over the original stdout (``imported``, then one
answer per command: ``build``, ``run`` (timed steps), ``profile``, ``stats``, ``exit``); prints go
to stderr (the worker's log).  This file also holds the megalm flags every megalm row runs with
(:data:`MEGALM_LLAMA_FLAGS`, :data:`MEGALM_FUSION_FLAGS`).  No torch.distributed: one process,
no communication besides the pipe to the parent.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
for _path in (REPO, os.path.abspath(os.path.dirname(__file__))):  # megalm; the other bench modules
    if _path not in sys.path:
        sys.path.insert(0, _path)

from reference_models import (  # noqa: E402
    BETAS,
    CLIP_GRAD,
    EPS,
    LR,
    SEED,
    THREADS,
    WEIGHT_DECAY,
    build_hf_model,
    build_plain_model,
    random_batches,
    reference_step,
    torch_adamw,
)

# --- what megalm is run with ----------------------------------------------------------------------
# Llama-style architecture; multi-head attention (no GQA), no dropout.
MEGALM_LLAMA_FLAGS = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--norm-epsilon",
    "1e-5",
]
# Fusions "on": megalm's defaults (every fusion enabled; the fused output layer + cross entropy
# is a default too, its Megatron flag is named anyway); "off": every fusion disabled.  Edit here
# when megalm grows a new fusion switch.
# A flag the megalm checkout in use does not know yet is left out (and named in the output), so the
# benchmark runs before and after a fusion lands; megalm flags mentioning "fusion" that appear in
# neither list are named in the output too.
MEGALM_FUSION_FLAGS = {
    "on": ["--cross-entropy-loss-fusion"],
    "off": [
        "--no-bias-gelu-fusion",
        "--no-bias-swiglu-fusion",
        "--no-rope-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--no-norm-fusion",
        "--no-cross-entropy-loss-fusion",
    ],
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def megalm_argv(shape: dict, precision: str, fusions: str, train_iters: int, loop: bool = False) -> List[str]:
    """megalm's flags for one row; ``loop``: the full-trainer-loop row logs every iteration."""
    b = str(shape["micro_batch"])
    return (
        [
            "--num-layers",
            str(shape["layers"]),
            "--hidden-size",
            str(shape["hidden"]),
            "--num-attention-heads",
            str(shape["heads"]),
            "--ffn-hidden-size",
            str(shape["ffn"]),
            "--seq-length",
            str(shape["seq"]),
            "--max-position-embeddings",
            str(shape["seq"]),
            # megalm's NullTokenizer (Megatron's) adds an end-of-document id to --vocab-size: V - 1 gives V.
            "--vocab-size",
            str(shape["vocab"] - 1),
            "--micro-batch-size",
            b,
            "--global-batch-size",
            b,
            "--train-iters",
            str(train_iters),
            "--mock-data",
            "--num-workers",
            "0",
            "--eval-iters",
            "0",
            "--log-interval",
            "1" if loop else str(10**9),
            "--no-log-memory",
            "--seed",
            str(SEED),
            "--lr",
            str(LR),
            "--lr-decay-style",
            "constant",
            "--weight-decay",
            str(WEIGHT_DECAY),
            "--adam-beta1",
            str(BETAS[0]),
            "--adam-beta2",
            str(BETAS[1]),
            "--adam-eps",
            str(EPS),
            "--clip-grad",
            str(CLIP_GRAD),
        ]
        + MEGALM_LLAMA_FLAGS
        + MEGALM_FUSION_FLAGS[fusions]
        + (["--bf16"] if precision == "bf16" else [])
    )


class Runner:
    """Builds one configuration; ``step()`` runs one full training step and returns the loss."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.shape = spec["shape"]
        impl = spec["impl"]
        import torch

        self.torch = torch
        if impl == "megalm":
            import pretrain_gpt  # noqa: F401  (imports megalm's model, data and training modules)
            from megalm.training import training  # noqa: F401
        elif impl == "hf":
            import transformers  # noqa: F401
            from transformers import LlamaForCausalLM  # noqa: F401
        torch.set_num_threads(THREADS)
        self.rss_after_import = _rss_bytes()

    def build(self) -> dict:
        torch, spec, shape = self.torch, self.spec, self.shape
        t0 = time.perf_counter()
        self.batches = random_batches(shape)
        self.batch_index = 0
        self.autocast = spec["impl"] != "megalm" and spec["precision"] == "bf16"
        if spec["impl"] == "megalm":
            self._build_megalm()
        else:
            self.model = build_plain_model(shape) if spec["impl"] == "plain" else build_hf_model(shape)
            self.model.train()
            self.optimizer = torch_adamw(self.model)
            self.params = list(self.model.parameters())
            self.n_params = sum(p.numel() for p in self.params)
        torch.set_num_threads(THREADS)  # megalm's start-up sets threads from the core count
        out = {
            "params": self.n_params,
            "setup_s": time.perf_counter() - t0,
            "rss_after_build": _rss_bytes(),
            "threads": torch.get_num_threads(),
        }
        if spec["impl"] == "megalm":
            import megalm

            out.update(
                megalm_argv=self.argv,
                megalm_path=os.path.dirname(megalm.__file__),
                dropped_flags=self.dropped_flags,
                unlisted_fusion_flags=self.unlisted_fusion_flags,
            )
        return out

    @staticmethod
    def compile_stats() -> Optional[dict]:
        """megalm's torch.compile counters (graphs compiled, seconds), when its fusions module exists."""
        try:
            from megalm.fusions import compile_stats
        except ImportError:
            return None
        s = compile_stats()
        return {"graphs": int(s.graphs), "seconds": float(s.seconds)}

    def _build_megalm(self) -> None:
        import pretrain_gpt
        from megalm.config import build_parser, parse_config
        from megalm.training.initialize import world_size_from_env
        from megalm.training.training import Trainer

        spec = self.spec
        known = set(build_parser()._option_string_actions)
        listed = {f for flags in MEGALM_FUSION_FLAGS.values() for f in flags}
        self.dropped_flags = [f for f in MEGALM_FUSION_FLAGS[spec["fusions"]] if f not in known]
        self.unlisted_fusion_flags = sorted(f for f in known if "fusion" in f and f not in listed)
        argv = [
            a
            for a in megalm_argv(
                self.shape, spec["precision"], spec["fusions"], spec["train_iters"], spec.get("loop", False)
            )
            if a not in self.dropped_flags
        ]
        cfg = parse_config(argv, world_size=world_size_from_env())
        trainer = Trainer(cfg, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
        trainer.setup()
        for chunk in trainer.model:
            chunk.train()
        self.trainer = trainer
        if spec.get("loop"):  # its own data loader, a log line per iteration (to the worker log)
            from megalm.log import setup_logging

            setup_logging(0, 1, stream=sys.stderr)
        elif spec["megalm_data"] == "random":
            trainer.train_iter = self._megalm_batches()
        self.n_params = sum(p.numel() for c in trainer.model for p in c.parameters())
        self.argv = argv

    def _megalm_batches(self):
        torch = self.torch
        positions = torch.arange(self.shape["seq"]).unsqueeze(0).expand(self.shape["micro_batch"], -1)
        ones = torch.ones(self.shape["micro_batch"], self.shape["seq"], dtype=torch.float32)
        while True:
            x = self._next_batch()
            yield {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": ones, "position_ids": positions}

    def _next_batch(self):
        x = self.batches[self.batch_index % len(self.batches)]
        self.batch_index += 1
        return x

    def step(self) -> float:
        if self.spec["impl"] == "megalm":
            from megalm.training.step import train_step

            t = self.trainer
            if self.spec.get("loop"):  # Trainer.train()'s body: step, log line, eval/save/exit checks
                out = t.train_iteration()
                loss = out.losses.get("lm loss")
                return float(loss) if loss is not None else float("nan")
            out = train_step(
                t.cfg,
                t.forward_step_func,
                t.train_iter,
                t.model,
                t.optimizer,
                t.scheduler,
                t.state,
                t.microbatches,
                t.groups,
            )
            loss = out.losses.get("lm loss")
            return float(loss) if loss is not None else float("nan")
        return reference_step(
            self.spec["impl"], self.model, self.optimizer, self.params, self._next_batch(), self.autocast
        )

    def run(self, steps: int) -> dict:
        times, cpu, losses = [], [], []
        for _ in range(steps):
            c0, t0 = time.process_time(), time.perf_counter()
            losses.append(self.step())
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out = {"times": times, "cpu_times": cpu, "losses": losses}
        if self.spec["impl"] == "megalm":
            out["compile"] = self.compile_stats()
        return out

    def profile(self, steps: int, row_limit: int) -> dict:
        """torch.profiler, one step at a time over ``steps`` steps (after one unprofiled step): per op
        the median over the steps of its self CPU time (robust to the other jobs of a shared machine
        descheduling us in the middle of one op) and its calls per step."""
        from torch.profiler import ProfilerActivity, profile

        self.step()  # not the first step after a pause
        per_op: Dict[str, List[float]] = {}
        calls: Dict[str, int] = {}
        walls, totals = [], []
        for i in range(steps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                self.step()
                walls.append(time.perf_counter() - t0)
            events = prof.key_averages()
            totals.append(sum(e.self_cpu_time_total for e in events))
            for e in events:
                per_op.setdefault(e.key, [0.0] * steps)[i] = e.self_cpu_time_total
                calls[e.key] = e.count
        med = {k: statistics.median(v) for k, v in per_op.items()}
        top = sorted(med, key=med.get, reverse=True)[:row_limit]
        return {
            "steps": steps,
            "wall_s": statistics.median(walls),
            "self_cpu_total_us": statistics.median(totals),
            "top": [{"op": k, "self_cpu_us": med[k], "calls": calls[k]} for k in top],
        }


def worker_main(spec_json: str) -> None:
    """Speaks JSON lines with the parent over the original stdout; prints go to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(spec_json)

    def send(msg):
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        runner = Runner(spec)
        send({"imported": True, "rss_after_import": runner.rss_after_import})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "build":
                send(runner.build())
            elif cmd["cmd"] == "run":
                send(runner.run(cmd["steps"]))
            elif cmd["cmd"] == "profile":
                send(runner.profile(cmd.get("steps", 3), cmd.get("rows", 15)))
            elif cmd["cmd"] == "stats":
                send({"maxrss": _maxrss_bytes(), "rss": _rss_bytes()})
            elif cmd["cmd"] == "exit":
                send({"bye": True})
                return
    except BaseException as e:  # noqa: BLE001 - report to the parent, then die
        import traceback

        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1)

#!/usr/bin/env python
"""Training-step throughput: megalm vs Hugging Face transformers vs a plain PyTorch loop.

What is compared (one process, 2 threads, the same shapes, the same random token batches, the same
optimizer: AdamW lr 1e-5, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only, fused
kernels where torch has them, global-norm clipping at 1.0; a full forward + backward + optimizer
step with the causal-LM loss over every position):

* **megalm**, built through its real trainer (``parse_config`` -> ``Trainer(cfg,
  pretrain_gpt.model_provider, pretrain_gpt.forward_step).setup()``, then ``train_step``), Llama-style
  flags (RMSNorm, SwiGLU, RoPE, untied output layer, no biases, no dropout, multi-head attention),
  fp32 and ``--bf16`` (bf16 weights, fp32 main weights and gradients), each with fusions **on**
  (megalm's defaults plus ``--cross-entropy-loss-fusion``) and **off** (every ``--no-*-fusion``);
  both flag lists are :data:`MEGALM_FUSION_FLAGS` in ``bench/throughput_worker.py``.  The trainer's
  mock-data loader is built (``--mock-data``) but the batches come from the same random-token
  iterator as the other rows (``--megalm-data mock`` feeds megalm's own loader instead);
* **Hugging Face** ``LlamaForCausalLM`` (random init, ``attn_implementation="sdpa"``, untied),
  fp32 and bf16 under ``torch.autocast("cpu", dtype=torch.bfloat16)`` with fp32 weights, as HF
  users run on CPU; loss through ``labels=`` (HF shifts them itself);
* **plain PyTorch**, a nanoGPT-style Llama written in ``bench/reference_models.py`` (RMSNorm, RoPE,
  SwiGLU, causal SDPA, untied head), fp32 and bf16 autocast: the "megalm should not be slower than
  this" reference.

Shapes (``ffn`` = 8h/3 rounded up to a multiple of 16, the Llama rule, given to every
implementation explicitly; vocabularies are multiples of 128 so megalm adds no padding rows and
every implementation has the same parameter count, which is asserted):

=======  ======  ======  =====  =====  ======  =====  ====  ====================
shape    hidden  layers  heads  seq    vocab   micro  ffn   tokens/step, params
=======  ======  ======  =====  =====  ======  =====  ====  ====================
tiny     256     4       4      256    8192    8      688   2,048, 7.4 M
medium   512     8       8      512    32000   4      1376  2,048, 58.1 M
toy      64      2       2      32     256     2      176   64 (tests only)
=======  ======  ======  =====  =====  ======  =====  ====  ====================

How it is measured (the machine is shared and noisy, 10-20%): every configuration runs in its own
persistent worker process (its own imports, model, optimizer state and peak RSS; workers import in
parallel, then build one after another); the parent drives them in rotating alternation so that
exactly one worker computes at a time: first ``--warmup`` untimed steps each (first steps,
torch.compile's first compiles; a compile during the timed steps is reported), then ``--rounds``
rounds in which each worker in turn runs a block of ``--steps`` timed steps (the rotation's start
shifts by one every round).  At ``medium`` a worker peaks at ~2.7 GB, so the fp32 rows and then the
bf16 rows are alternated as two groups (``--alternate``); every ratio is within one precision.

Each row reports the median step time over all its timed steps (and half the interquartile range),
tokens/s = micro-batch x seq / median, model TFLOP/s and MFU from megalm's own formula and peak
(:func:`megalm.flops.num_floating_point_operations`; :func:`~megalm.flops.device_peak_flops`,
a measured 1024^3 matmul per precision, here the best of its measurements at the start, after a 1 s
warm-up, and after every round), speed ratios to the HF row and to the plain-PyTorch row of the
same precision and shape (> 1: faster), the worker's peak RSS (``ru_maxrss``) and its increase over
the worker's RSS right after its imports, and the first warm-up step's time.  "CPU s/step" is the
worker's user + system CPU time per step (median; ~2x the step time when both threads are busy):
on a crowded machine it grows much less than the wall time, so it tells load from slowness.
``--profile`` adds per-row torch.profiler tables (per op: median self CPU time over
``--profile-steps`` steps).

    python bench/train_throughput.py                       # tiny and medium, all rows (~12 min)
    python bench/train_throughput.py --shape tiny          # ~4 min
    python bench/train_throughput.py --quick               # smoke run
    python bench/train_throughput.py --shape tiny --only megalm,plain --precision bf16 \\
        --json out.json --plot out.png --profile           # + per-row torch.profiler top ops

Needs ``transformers`` for the HF rows and ``matplotlib`` for ``--plot`` (``pip install -e .[bench]``).

This file holds the CLI and the parent side (starting the worker processes, alternating them,
turning their step times into rows); ``bench/throughput_worker.py`` the worker side (megalm's
flags, building one configuration and timing its steps);
``bench/reference_models.py`` the shapes, optimizer settings and the HF and plain-PyTorch models;
``bench/throughput_report.py`` FLOPs, matmul peaks, the tables and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
for _path in (REPO, os.path.abspath(os.path.dirname(__file__))):  # megalm; the other bench modules
    if _path not in sys.path:
        sys.path.insert(0, _path)

from json_worker import JsonWorker  # noqa: E402
from reference_models import (  # noqa: E402
    IMPL_NAMES,
    PRECISIONS,
    SHAPES,
    THREADS,
)
from throughput_report import (  # noqa: E402
    flops_per_step,
    markdown_table,
    measure_peaks,
    notes,
    plot,
    profile_tables,
    quantile,
    update_peaks,
)
from throughput_worker import MEGALM_FUSION_FLAGS, MEGALM_LLAMA_FLAGS, worker_main  # noqa: E402

# Timed steps per block when --steps is not given (medium steps cost ~8x tiny ones).
DEFAULT_STEPS = {"tiny": 6, "medium": 2, "toy": 2}
# Which workers are alive and alternated together (--alternate auto): at medium a worker peaks at
# ~2-3 GB, so the fp32 rows and then the bf16 rows are run as two groups.
DEFAULT_ALTERNATE = {"tiny": "all", "medium": "precision", "toy": "all"}


class Worker(JsonWorker):
    def __init__(self, name: str, spec: dict, log_dir: str):
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(THREADS),
            MKL_NUM_THREADS=str(THREADS),
            TOKENIZERS_PARALLELISM="false",
            TRANSFORMERS_VERBOSITY="error",
            PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        super().__init__(name, __file__, spec, log_dir, env=env, cwd=REPO)


def config_list(args) -> List[dict]:
    """Rows in table order: per precision, megalm (fusions on, off), HF, plain."""
    out = []
    for precision in PRECISIONS:
        for impl in IMPL_NAMES:
            if precision not in args.precision or impl not in args.only:
                continue
            for fusions in [f for f in MEGALM_FUSION_FLAGS if f in args.fusions] if impl == "megalm" else [None]:
                out.append({"impl": impl, "precision": precision, "fusions": fusions})
                if impl == "megalm" and args.trainer_loop:
                    out.append({"impl": impl, "precision": precision, "fusions": fusions, "loop": True})
    return out


def config_name(c: dict) -> str:
    return f"{c['impl']}{'-' + c['fusions'] if c['fusions'] else ''}{'+loop' if c.get('loop') else ''}/{c['precision']}"


def add_loop_ratios(rows: List[dict]) -> None:
    """``vs_step`` of each full-trainer-loop row: its tokens/s over the raw ``train_step`` row's
    (same shape, precision and fusions; 1.0 = the loop costs nothing)."""
    for row in rows:
        if row.get("loop"):
            raw = next(
                r
                for r in rows
                if r["impl"] == "megalm"
                and not r.get("loop")
                and (r["shape"], r["precision"], r["fusions"]) == (row["shape"], row["precision"], row["fusions"])
            )
            row["vs_step"] = row["tokens_per_s"] / raw["tokens_per_s"]


def alternation_groups(shape_name: str, configs: List[dict], mode: str) -> List[List[dict]]:
    """Configurations alternated together: all of them, or one group per precision (every ratio the
    table prints is within one precision; halves the workers alive at once)."""
    if mode == "auto":
        mode = DEFAULT_ALTERNATE.get(shape_name, "all")
    if mode == "all":
        return [configs]
    groups = [[c for c in configs if c["precision"] == p] for p in PRECISIONS]
    return [g for g in groups if g]


def run_group(shape_name: str, configs: List[dict], args, steps: int, log_dir: str, peaks: dict) -> Dict[str, dict]:
    """Start one worker per configuration, warm them up, alternate them; raw results per config name."""
    shape = SHAPES[shape_name]
    train_iters = args.warmup + args.rounds * steps + args.profile_steps + 10
    workers: List[Worker] = []
    res: Dict[str, dict] = {}
    try:
        # Imports overlap (nothing is measured yet); builds and everything after run one worker at a time.
        for c in configs:
            spec = dict(c, shape=shape, train_iters=train_iters, megalm_data=args.megalm_data)
            workers.append(Worker(f"{shape_name}-{config_name(c)}", spec, log_dir))
        for w in workers:
            res[w.name] = {"info": w.receive(), "times": [], "cpu_times": [], "compile_end": None}
        for w in workers:
            res[w.name]["info"].update(w.call(cmd="build"))
            print(
                f"  built {w.name}: {res[w.name]['info']['params']:,} parameters, "
                f"{res[w.name]['info']['setup_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        for w in workers:
            r = w.call(cmd="run", steps=args.warmup)
            res[w.name].update(
                warmup=r["times"], first_loss=r["losses"][0] if r["losses"] else None, compile_warm=r.get("compile")
            )
        for rnd in range(args.rounds):
            shift = rnd % len(workers)
            for w in workers[shift:] + workers[:shift]:
                r = w.call(cmd="run", steps=steps)
                res[w.name]["times"] += r["times"]
                res[w.name]["cpu_times"] += r["cpu_times"]
                res[w.name].update(last_loss=r["losses"][-1], compile_end=r.get("compile"))
                if res[w.name]["first_loss"] is None:
                    res[w.name]["first_loss"] = r["losses"][0]
            update_peaks(peaks, measure_peaks(0.2, 1, args.precision))  # between blocks: nothing else of ours computes
            print(
                f"  round {rnd + 1}/{args.rounds}: "
                + ", ".join(
                    f"{w.name.split('-', 1)[1]} {statistics.median(res[w.name]['times']) * 1e3:.0f} ms" for w in workers
                ),
                file=sys.stderr,
                flush=True,
            )
        for w in workers:
            if args.profile:
                res[w.name]["profile"] = w.call(cmd="profile", steps=args.profile_steps, rows=args.profile_rows)
            res[w.name]["stats"] = w.call(cmd="stats")
    finally:
        for w in workers:
            w.close()
    return res


def run_shape(shape_name: str, args, peaks: dict, log_dir: str) -> List[dict]:
    shape = SHAPES[shape_name]
    steps = args.steps or DEFAULT_STEPS[shape_name]
    configs = config_list(args)
    groups = alternation_groups(shape_name, configs, args.alternate)
    print(
        f"\n## shape {shape_name}: "
        + ", ".join(f"{k} {v}" for k, v in shape.items())
        + f" | {len(configs)} workers in {len(groups)} alternation group(s), warm-up {args.warmup}, "
        f"{args.rounds} rounds x {steps} steps",
        file=sys.stderr,
        flush=True,
    )
    res: Dict[str, dict] = {}
    for group in groups:
        res.update(run_group(shape_name, group, args, steps, log_dir, peaks))
    names = {config_name(c): f"{shape_name}-{config_name(c)}" for c in configs}
    counts = {n: res[n]["info"]["params"] for n in names.values()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"error: parameter counts differ at shape {shape_name}: {counts}")

    flops = flops_per_step(shape)
    tokens = shape["micro_batch"] * shape["seq"]
    rows: List[dict] = []
    for c in configs:
        r = res[names[config_name(c)]]
        info, ts = r["info"], r["times"]
        med = statistics.median(ts)
        rows.append(
            {
                "shape": shape_name,
                "impl": c["impl"],
                "loop": bool(c.get("loop")),
                "implementation": "megalm through the full trainer loop" if c.get("loop") else IMPL_NAMES[c["impl"]],
                "precision": c["precision"],
                "fusions": c["fusions"],
                "name": config_name(c),
                "group": next(i for i, g in enumerate(groups) if c in g),
                "params": info["params"],
                "tokens_per_step": tokens,
                "flops_per_step": flops,
                "step_times_s": ts,
                "warmup_times_s": r["warmup"],
                "median_step_s": med,
                "step_cpu_s": r["cpu_times"],
                "median_cpu_s": statistics.median(r["cpu_times"]),
                "iqr_rel": (quantile(ts, 0.75) - quantile(ts, 0.25)) / med,
                "tokens_per_s": tokens / med,
                "tflops": flops / med / 1e12,
                "maxrss_mb": r["stats"]["maxrss"] / 2**20,
                "rss_after_import_mb": info["rss_after_import"] / 2**20,
                "rss_increase_mb": (r["stats"]["maxrss"] - info["rss_after_import"]) / 2**20,
                "setup_s": info["setup_s"],
                "first_loss": r["first_loss"],
                "last_loss": r.get("last_loss"),
                "threads": info["threads"],
                "profile": r.get("profile"),
                "compile_after_warmup": r.get("compile_warm"),
                "compile_at_end": r.get("compile_end"),
                "megalm_argv": info.get("megalm_argv"),
                "megalm_path": info.get("megalm_path"),
                "dropped_flags": info.get("dropped_flags"),
                "unlisted_fusion_flags": info.get("unlisted_fusion_flags"),
            }
        )
    for row in rows:
        for ref, key in (("hf", "vs_hf"), ("plain", "vs_plain")):
            other = next((r for r in rows if r["impl"] == ref and r["precision"] == row["precision"]), None)
            row[key] = row["tokens_per_s"] / other["tokens_per_s"] if other else None
    add_loop_ratios(rows)
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shape",
        default="all",
        choices=["tiny", "medium", "all", "toy"],
        help="all = tiny then medium; toy is for tests",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help=f"timed steps per block (default per shape: {DEFAULT_STEPS})"
    )
    ap.add_argument("--rounds", type=int, default=None, help="rounds of alternation (default 5; --quick 2)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per worker before the rounds (default 2; --quick 1)"
    )
    ap.add_argument("--only", default="megalm,hf,plain", help="comma list of megalm, hf, plain")
    ap.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--fusions", default="on,off", help="megalm rows: comma list of on, off")
    ap.add_argument(
        "--alternate",
        default="auto",
        choices=["auto", "all", "precision"],
        help=f"alternate all rows of a shape together, or each precision's rows as a group (auto: {DEFAULT_ALTERNATE})",
    )
    ap.add_argument(
        "--megalm-data",
        default="random",
        choices=["random", "mock"],
        help="megalm's batches: the shared random tokens (default) or its --mock-data loader",
    )
    ap.add_argument(
        "--trainer-loop",
        action="store_true",
        help="add a row per megalm row: megalm through the full trainer loop (its data loader, a log "
        "line every iteration, timers at level 0), with its speed ratio to the raw train_step row",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: warm-up 1, 2 rounds of 1 step (explicit --warmup/--rounds/--steps win)",
    )
    ap.add_argument("--profile", action="store_true", help="after timing, torch.profiler top ops of every row")
    ap.add_argument(
        "--profile-steps", type=int, default=3, help="steps profiled per row (default 3; per op the median)"
    )
    ap.add_argument("--profile-rows", type=int, default=15, help="ops listed per row (default 15)")
    ap.add_argument("--json", default=None, help="write every row (with all step times) here")
    ap.add_argument("--plot", default=None, help="write a bar chart (PNG) here; needs matplotlib")
    ap.add_argument("--log-dir", default=None, help="worker logs (default: a temporary directory)")
    args = ap.parse_args(argv)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    args.precision = [x.strip() for x in args.precision.split(",") if x.strip()]
    args.fusions = [x.strip() for x in args.fusions.split(",") if x.strip()]
    for name, values, allowed in (
        ("--only", args.only, IMPL_NAMES),
        ("--precision", args.precision, PRECISIONS),
        ("--fusions", args.fusions, MEGALM_FUSION_FLAGS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            ap.error(f"{name}: {bad or values} not in {list(allowed)}")
    quick = {"warmup": 1, "rounds": 2, "steps": 1} if args.quick else {"warmup": 2, "rounds": 5, "steps": None}
    for key, value in quick.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.shape == "all" and args.quick:
        args.shapes = ["tiny"]
    else:
        args.shapes = ["tiny", "medium"] if args.shape == "all" else [args.shape]
    if args.rounds < 1 or args.warmup < 0 or (args.steps is not None and args.steps < 1):
        ap.error("--rounds and --steps must be >= 1, --warmup >= 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install matplotlib (or pip install -e .[bench])")
    if "hf" in args.only:
        try:
            import transformers  # noqa: F401
        except ImportError:
            ap.error("the HF rows need transformers: pip install transformers (or drop hf from --only)")
    return args


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    import tempfile

    import torch

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="megalm-train-throughput-")
    os.makedirs(log_dir, exist_ok=True)
    t_start = time.perf_counter()
    peaks = measure_peaks(*((0.2, 1) if args.quick else (1.0, 3)), precisions=args.precision)
    print(
        f"matmul peaks ({THREADS} threads): "
        + ", ".join(f"{k} {v['flops'] / 1e9:.0f} GFLOP/s ({v['source']})" for k, v in peaks.items()),
        file=sys.stderr,
    )
    rows: List[dict] = []
    for shape_name in args.shapes:
        rows += run_shape(shape_name, args, peaks, log_dir)
    elapsed = time.perf_counter() - t_start
    for r in rows:  # against the best peak measured during the whole run
        r["peak_flops"] = peaks[r["precision"]]["flops"]
        r["mfu"] = r["flops_per_step"] / r["median_step_s"] / r["peak_flops"]

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    print(
        f"\nTraining-step throughput, {THREADS} threads, fwd+bwd+AdamW; median of "
        f"{len(rows[0]['step_times_s'])} alternated steps per row"
        if rows
        else ""
    )
    print(markdown_table(rows))
    measured = ", ".join(f"{k} {v['flops'] / 1e9:.0f} GFLOP/s" for k, v in peaks.items())
    print(
        f"\nMFU against the best matmul peak measured during the run: {measured} (megalm's device_peak_flops: a "
        f"1024^3 matmul, best of {next(iter(peaks.values()))['measurements']}); "
        f"FLOPs per step: "
        + ", ".join(f"{s} {flops_per_step(SHAPES[s]) / 1e9:.1f} G" for s in args.shapes)
        + f". torch {torch.__version__}, transformers {tf_version}. Total {elapsed:.0f} s."
    )
    for note in notes(rows):
        print(f"- {note}")
    for r in rows:
        if r.get("loop"):
            print(
                f"- {r['shape']} {r['precision']} fusions {r['fusions']}: full trainer loop / raw train_step "
                f"tokens/s = {r['vs_step']:.3f} ({100 * (1 - r['vs_step']):+.1f}% loop cost)"
            )
    if args.profile:
        print(profile_tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "peaks": peaks,
                    "threads": THREADS,
                    "torch": torch.__version__,
                    "transformers": tf_version,
                    "megalm_fusion_flags": MEGALM_FUSION_FLAGS,
                    "megalm_llama_flags": MEGALM_LLAMA_FLAGS,
                    "args": {k: v for k, v in vars(args).items()},
                    "elapsed_s": elapsed,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
        worker_main(sys.argv[2])
    else:
        main()

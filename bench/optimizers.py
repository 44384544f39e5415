#!/usr/bin/env python
"""Validation loss vs tokens for AdamW, LAMB, LARS, Muon and Lion at global batch B and 8 B, each at a searched
learning rate, all in one process on whatever device megalm picks (one GPU with CUDA, else the CPU).

Data: the quickstart's corpus (the Python standard library's sources, its 8k sentencepiece BPE tokenizer,
Megatron ``.bin/.idx``: ``--data-dir`` holding ``stdlib_text_document.{bin,idx}`` and ``tokenizer.model``, e.g.
``quickstart_out/``; without it ``examples/quickstart.sh``'s steps 2-4 build it into a temp dir first).  Model:
the quickstart's GPT (4 layers, hidden 256, 4 heads, sequence 128, the 8k vocabulary: 5.3M parameters), bf16
with fp32 main weights, no dropout, weight decay 0.1, gradient clipping 1.0, one seed (the same initial
model and data order for every run), 98% / 2% train / validation split.  Each run is one
``pretrain_gpt.main`` call in this process (as ``bench/cuda_feature_check.py``), no launcher.

1. Learning-rate search: each optimizer at batch B for ``--grid-iters`` iterations at each learning rate of
   its grid (``OPTIMIZERS``; six values a factor 2 apart), 10% linear warm-up, cosine decay to 10% of the
   peak; the one with the lowest validation loss at the end (``EVAL_SAMPLES`` samples, the same for every
   run) is that optimizer's learning rate at B.
2. Full runs at batch B and 8 B over the same training tokens (8x fewer iterations at 8 B), warm-up over
   10% of the iterations (the same tokens at both batches), cosine decay to 10%, ``EVALS`` evaluations at the
   same token counts, each on ``EVAL_SAMPLES`` validation samples (evaluation ``i`` reads the same samples in
   every run).  The learning rate at 8 B is the searched one scaled by the optimizer's own rule (``RULES``):
   the square root of 8 for AdamW (Malladi et al., 2022), LAMB (its paper), Lion and Muon (whose step size,
   like Adam's, is set by a normalized or sign direction; Muon's update RMS is matched to AdamW's with
   ``--muon-extra-scale-factor 0.2``), and 8 (linear) for LARS, SGD with momentum whose paper pairs the
   linear rule (Goyal et al., 2017) with warm-up.
3. Time budget: the tokens per full run are ``--tokens`` unless the search's measured step times (and one
   short probe at 8 B) predict that the full runs would end after ``--budget-s`` seconds from the start; then
   the largest token count that fits (the JSON records both).

Writes into ``--out``: ``optimizers.json`` (settings, device, every search and full run: learning rate,
validation curve, ms per iteration, seconds; rewritten after each run, so a cut-short invocation keeps what
ran), ``optimizers_b<B>.svg`` and ``optimizers_b<8B>.svg`` (validation loss vs tokens),
``optimizers_lr_search.svg`` and ``optimizers_table.md`` (the tables of docs/benchmarks.md).  Training metrics and the
dataset cache go to a temp dir, never into ``--data-dir``.

    python3 bench/optimizers.py --data-dir quickstart_out --out bench/results      # one GPU: ~5 minutes (H100)
    python3 bench/optimizers.py --cpu-smoke --data-dir quickstart_out --out /tmp/o # the script end to end, tiny
    python3 bench/optimizers.py --report bench/results/optimizers.json [--out DIR] # tables (+ charts) again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

EVALS = 8  # evaluations per full run
EVAL_SAMPLES = 256  # validation samples per evaluation (the same at both batches)
SMOKE_EVAL_SAMPLES = 32
FACTOR = 8  # the large batch is FACTOR x the small one
# The quickstart's GPT; --cpu-smoke swaps in SMOKE_MODEL.
MODEL = {"num-layers": 4, "hidden-size": 256, "num-attention-heads": 4, "seq-length": 128}
SMOKE_MODEL = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 32}
COMMON = [
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--weight-decay", "0.1",
    "--clip-grad", "1.0", "--lr-decay-style", "cosine", "--split", "98,2,0", "--seed", "1234", "--bf16",
    "--no-log-memory", "--logging-level", "30",
]  # fmt: skip
# name -> (flags, learning rates searched at batch B)
OPTIMIZERS = {
    "adam": (["--optimizer", "adam", "--adam-beta2", "0.95"], [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3]),
    "lamb": (["--optimizer", "lamb", "--adam-beta2", "0.95"], [2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2, 8e-2]),
    # each matrix moves by about lr x 0.01 x ||w|| / (1 - momentum) per step; biases and norms: SGD at lr
    "lars": (
        ["--optimizer", "lars", "--lars-trust-coefficient", "0.01", "--sgd-momentum", "0.9"],
        [0.1, 0.2, 0.4, 0.8, 1.6, 3.2],
    ),
    "muon": (
        ["--optimizer", "muon", "--muon-extra-scale-factor", "0.2", "--muon-use-nesterov", "--adam-beta2", "0.95"],
        [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2],
    ),
    "lion": (["--optimizer", "lion"], [5e-5, 1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3]),
}  # fmt: skip
RULES = {"adam": "sqrt", "lamb": "sqrt", "lars": "linear", "muon": "sqrt", "lion": "sqrt"}
NAMES = {"adam": "AdamW", "lamb": "LAMB", "lars": "LARS", "muon": "Muon", "lion": "Lion"}
DETAILS = {
    "adam": "AdamW (β2 0.95)",
    "lamb": "LAMB (β2 0.95)",
    "lars": "LARS (trust coefficient 0.01, momentum 0.9)",
    "muon": "Muon (Nesterov, extra scale 0.2; AdamW at the same lr for the rest)",
    "lion": "Lion (β 0.9 / 0.99)",
}


def scaled_lr(lr: float, rule: str, factor: int) -> float:
    """The learning rate at ``factor`` x the batch: ``lr sqrt(factor)`` or ``lr factor``."""
    return lr * (math.sqrt(factor) if rule == "sqrt" else factor)


def build_corpus(out: str) -> None:
    """The quickstart's corpus, tokenizer and ``.bin/.idx`` files in ``out`` (its steps 2-4)."""
    py, env = sys.executable, dict(os.environ, PYTHONPATH=ROOT)
    steps = [
        [py, f"{ROOT}/examples/build_stdlib_corpus.py", "--output", "corpus.jsonl", "--max-mb", "20"],
        [py, f"{ROOT}/tools/train_tokenizer.py", "--input", "corpus.jsonl", "--json-keys", "text"]
        + ["--model-prefix", "tokenizer", "--vocab-size", "8192", "--model-type", "bpe", "--byte-fallback"],
        [py, f"{ROOT}/tools/preprocess_data.py", "--input", "corpus.jsonl", "--json-keys", "text"]
        + ["--output-prefix", "stdlib", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
        + ["tokenizer.model", "--append-eod", "--workers", "2", "--no-progress"],
    ]
    for cmd in steps:
        subprocess.run(cmd, cwd=out, env=env, check=True, stdout=subprocess.DEVNULL)


def run_argv(
    model: dict,
    data: list,
    micro_batch: int,
    name: str,
    lr: float,
    gbs: int,
    iters: int,
    evals: int,
    metrics: str,
    eval_samples: int = EVAL_SAMPLES,
) -> list:
    """One run's flags: ``name`` at peak ``lr``, warm-up over 10% of ``iters``, cosine to lr / 10, ``evals``
    evaluations of ``eval_samples`` samples (the last after training; 1: that one only), a log line per
    evaluation interval (4 in all with one evaluation), micro batches of at most ``micro_batch``."""
    interval = max(1, iters // evals)
    flags = [x for k, v in model.items() for x in (f"--{k}", str(v))]
    flags += ["--max-position-embeddings", str(model["seq-length"])]
    return (
        flags
        + COMMON
        + data
        + OPTIMIZERS[name][0]
        + ["--lr", f"{lr:.6g}", "--min-lr", f"{lr / 10:.6g}", "--lr-warmup-iters", str(max(1, iters // 10))]
        + ["--micro-batch-size", str(min(gbs, micro_batch)), "--global-batch-size", str(gbs)]
        + ["--train-iters", str(iters), "--eval-interval", str(interval if evals > 1 else iters)]
        + ["--eval-iters", str(eval_samples // gbs), "--metrics-file", metrics]
        + ["--log-interval", str(interval if evals > 1 else max(1, iters // 4))]
    )


class Bench:
    """One invocation: the settings, the runs so far (saved to ``optimizers.json`` after each)."""

    def __init__(self, args, data_dir: str, tmp: str):
        self.args, self.tmp = args, tmp
        self.model = SMOKE_MODEL if args.cpu_smoke else MODEL
        self.seq = self.model["seq-length"]
        self.eval_samples = SMOKE_EVAL_SAMPLES if args.cpu_smoke else EVAL_SAMPLES
        self.data = ["--data-path", os.path.join(data_dir, "stdlib_text_document"), "--tokenizer-type"]
        self.data += ["SentencePieceTokenizer", "--tokenizer-model", os.path.join(data_dir, "tokenizer.model")]
        self.data += ["--data-cache-path", os.path.join(tmp, "cache")]
        self.start = time.monotonic()
        self.saved = {"settings": self.settings(), "search": {}, "chosen": {}, "runs": {}}

    def settings(self) -> dict:
        import torch

        a = self.args
        device = torch.cuda.get_device_name(0) if not a.cpu_smoke and torch.cuda.is_available() else "cpu"
        return {
            "device": device,
            "torch": torch.__version__,
            "model": self.model,
            "batch": a.batch,
            "factor": FACTOR,
            "grid_iters": a.grid_iters,
            "tokens_asked": a.tokens,
            "evals": EVALS,
            "eval_samples": self.eval_samples,
            "budget_s": a.budget_s,
            "rules": RULES,
            "flags": {n: OPTIMIZERS[n][0] for n in a.optimizers},
        }

    def train(self, key: str, name: str, lr: float, gbs: int, iters: int, evals: int) -> dict:
        """One training in this process; its validation curve, ms per iteration and seconds."""
        import pretrain_gpt
        from megalm import parallel_state

        metrics = os.path.join(self.tmp, key.replace(" ", "_") + ".jsonl")
        begin = time.monotonic()
        code = 0
        try:
            pretrain_gpt.main(
                run_argv(
                    self.model,
                    self.data,
                    self.args.micro_batch,
                    name,
                    lr,
                    gbs,
                    iters,
                    evals,
                    metrics,
                    self.eval_samples,
                )
            )
        except SystemExit as e:  # a stop (NaN loss, say) keeps its curve so far; the others go on
            code = e.code if isinstance(e.code, int) else str(e.code)
        except Exception as e:  # noqa: BLE001 - reported next to the numbers
            code = f"{type(e).__name__}: {str(e)[:200]}"
        parallel_state.destroy_model_parallel()
        curve, ms = read_metrics(metrics, gbs * self.seq)
        r = {"lr": lr, "batch": gbs, "iters": iters, "code": code, "curve": curve, "ms_per_iter": ms}
        r["seconds"] = time.monotonic() - begin
        last = f"{curve[-1][1]:.4f}" if curve else "none"
        print(
            f"[{time.monotonic() - self.start:6.0f}s] {key}: lr {lr:.4g}, batch {gbs}, {iters} it, val loss {last}, "
            f"{ms:.1f} ms/it, {r['seconds']:.1f} s{'' if code == 0 else f', stopped: {code}'}",
            flush=True,
        )
        return r

    def save(self) -> None:
        self.saved["settings"]["elapsed_s"] = time.monotonic() - self.start
        with open(os.path.join(self.args.out, "optimizers.json"), "w") as f:
            json.dump(self.saved, f, indent=1)

    def search(self) -> None:
        """Step 1: every grid point at batch B; the lowest final validation loss wins."""
        a = self.args
        for name in a.optimizers:
            rows = self.saved["search"][name] = []
            for lr in OPTIMIZERS[name][1][: a.grid_points]:
                rows.append(self.train(f"search {name} {lr:.4g}", name, lr, a.batch, a.grid_iters, 1))
                self.save()
            self.saved["chosen"][name] = best_lr(rows)
            print(f"  {name}: searched lr {self.saved['chosen'][name]:.4g}", flush=True)

    def plan(self) -> int:
        """Step 3: iterations at 8 B for the full runs: ``--tokens`` worth, or fewer if the budget says so."""
        a = self.args
        per_step = self.seq * a.batch * FACTOR
        asked = max(EVALS, a.tokens // per_step // EVALS * EVALS)
        probe = self.train("probe adam x8", "adam", self.saved["chosen"].get("adam", 1e-3), a.batch * FACTOR, 4, 1)
        self.saved["probe"] = probe
        big_ms = probe["ms_per_iter"] if math.isfinite(probe["ms_per_iter"]) else float("inf")
        fixed, per_iter = 0.0, 0.0  # seconds of the full runs: fixed + per_iter x (iterations at 8 B)
        adam_ms = search_ms(self.saved["search"].get("adam", []))
        for name in a.optimizers:
            rows = self.saved["search"][name]
            small_ms = search_ms(rows)
            setups = [r["seconds"] - r["iters"] * r["ms_per_iter"] / 1000 for r in rows]
            setup = min([x for x in setups if math.isfinite(x)], default=0.0)
            big = big_ms + (small_ms - adam_ms if math.isfinite(adam_ms) else 0.0)  # the optimizer's own cost
            evals = EVALS * (self.eval_samples / (a.batch * FACTOR) * big + self.eval_samples / a.batch * small_ms) / 2
            fixed += 2 * setup + evals / 1000  # a forward pass: taken as half a training step
            per_iter += (FACTOR * small_ms + big) / 1000
        left = a.budget_s - (time.monotonic() - self.start) - fixed
        known = per_iter > 0 and math.isfinite(per_iter + fixed)  # else no estimate: the tokens asked
        fits = int(left / per_iter) // EVALS * EVALS if known else asked
        iters = max(EVALS, min(asked, fits))
        self.saved["settings"].update(
            iters_at_large_batch=iters, tokens=iters * per_step, tokens_fit=max(0, fits) * per_step
        )
        print(
            f"  plan: {iters} iterations at batch {a.batch * FACTOR}, {FACTOR * iters} at {a.batch}: "
            f"{iters * per_step:,} tokens per run (asked {a.tokens:,}; the budget fits {max(0, fits) * per_step:,}); "
            f"predicted {fixed + iters * per_iter:.0f} s more",
            flush=True,
        )
        return iters

    def full_runs(self, iters: int) -> None:
        """Step 2: every optimizer at B and 8 B (optimizer-major: a cut-short invocation leaves whole pairs)."""
        a = self.args
        for name in a.optimizers:
            lr = self.saved["chosen"][name]
            for factor in (1, FACTOR):
                lr_f = scaled_lr(lr, RULES[name], factor)
                key = f"{name} x{factor}"
                self.saved["runs"][key] = self.train(key, name, lr_f, a.batch * factor, iters * FACTOR // factor, EVALS)
                self.save()


def read_metrics(metrics: str, tokens_per_iter: int) -> tuple:
    """``([(training tokens, validation loss)], mean ms per iteration after the first log line)`` from a
    metrics file (a constant batch: ``tokens_per_iter`` per iteration)."""
    if not os.path.exists(metrics):
        return [], float("nan")
    rows = [json.loads(line) for line in open(metrics)]
    curve = [(r["iteration"] * tokens_per_iter, r["loss"]) for r in rows if r.get("split") == "validation"]
    times = [r["elapsed_ms"] for r in rows if "elapsed_ms" in r]
    times = times[1:] or times  # the first interval includes start-up
    return curve, (sum(times) / len(times) if times else float("nan"))


def final_loss(run: dict) -> float:
    """The last validation loss of a run (inf if it has none or it is not finite)."""
    loss = run["curve"][-1][1] if run["curve"] else float("inf")
    return loss if math.isfinite(loss) else float("inf")


def best_lr(rows: list) -> float:
    """The learning rate of the lowest final validation loss (the first grid point if none finished)."""
    return min(rows, key=final_loss)["lr"]


def search_ms(rows: list) -> float:
    """The median ms per iteration of an optimizer's search runs (inf without any)."""
    ms = sorted(r["ms_per_iter"] for r in rows if math.isfinite(r["ms_per_iter"]))
    return ms[len(ms) // 2] if ms else float("inf")


def init_distributed(cpu: bool) -> None:
    """One rank: NCCL on GPU 0, or gloo on the CPU (``--cpu-smoke`` or no CUDA)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", WANDB_MODE="disabled")
    if cpu or not torch.cuda.is_available():
        os.environ["MEGALM_FORCE_CPU"] = "1"
        dist.init_process_group("gloo")
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)


def table(saved: dict) -> str:
    """The tables of docs/benchmarks.md (Markdown): the search, then the full runs (last validation loss, each also as a
    ratio to AdamW's at the same batch, the 8 B loss over the B loss at equal tokens, time per iteration as
    a ratio to AdamW's at the same batch)."""
    st, runs = saved["settings"], saved["runs"]
    b, big = st["batch"], st["batch"] * st["factor"]
    names = [n for n in OPTIMIZERS if n in saved["search"]]
    grid = max((len(saved["search"][n]) for n in names), default=0)
    lines = [
        f"Learning-rate search: validation loss after {st['grid_iters']} iterations at batch {b} "
        f"({st['grid_iters'] * b * st['model']['seq-length']:,} tokens), the chosen learning rate in bold.",
        "",
        "| optimizer | " + " | ".join(f"lr {i + 1}: loss" for i in range(grid)) + " |",
        "|---|" + "---|" * grid,
    ]
    for n in names:
        chosen = saved["chosen"].get(n)
        cells = []
        for r in saved["search"][n]:
            cell = f"{r['lr']:.3g}: {final_loss(r):.3f}"
            cells.append(f"**{cell}**" if r["lr"] == chosen else cell)
        lines.append(f"| {DETAILS[n]} | " + " | ".join(cells) + " |")
    tokens = st.get("tokens")
    lines += [
        "",
        f"Full runs: {tokens:,} training tokens at both batches." if tokens else "Full runs: not run.",
        "",
        f"| optimizer | rule | lr at {b} | lr at {big} | val loss at {b} | vs AdamW | val loss at {big} | vs AdamW "
        f"| {big} / {b} | ms/iter at {b} vs AdamW | ms/iter at {big} vs AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        small, large = runs.get(f"{n} x1"), runs.get(f"{n} x{st['factor']}")
        if not small or not large:
            continue
        ref_s, ref_l = runs.get("adam x1", small), runs.get(f"adam x{st['factor']}", large)
        ls, ll = final_loss(small), final_loss(large)
        cells = [DETAILS[n], st["rules"][n], f"{small['lr']:.3g}", f"{large['lr']:.3g}"]
        cells += [f"{ls:.3f}", f"{ls / final_loss(ref_s):.3f}", f"{ll:.3f}", f"{ll / final_loss(ref_l):.3f}"]
        cells += [f"{ll / ls:.3f}", f"{small['ms_per_iter'] / ref_s['ms_per_iter']:.2f}"]
        cells.append(f"{large['ms_per_iter'] / ref_l['ms_per_iter']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def charts(saved: dict, out: str) -> None:
    """Validation loss vs tokens at each batch, and the search's loss vs log2 learning rate."""
    from svg_plot import write_line_chart

    st, runs = saved["settings"], saved["runs"]
    m = st["model"]
    what = f"GPT {m['num-layers']} x {m['hidden-size']} on the quickstart corpus"
    for factor in (1, st["factor"]):
        gbs = st["batch"] * factor
        series = {
            NAMES[n]: [(t, v) for t, v in runs[f"{n} x{factor}"]["curve"] if math.isfinite(v)]
            for n in OPTIMIZERS
            if f"{n} x{factor}" in runs
        }
        series = {k: v for k, v in series.items() if v}
        if series:
            write_line_chart(
                os.path.join(out, f"optimizers_b{gbs}.svg"),
                series,
                title=f"{what}, global batch {gbs} (x {m['seq-length']} tokens)",
                xlabel="training tokens",
                ylabel="validation loss",
            )
    search = {
        NAMES[n]: [(math.log2(r["lr"]), final_loss(r)) for r in rows if math.isfinite(final_loss(r))]
        for n, rows in saved["search"].items()
    }
    search = {k: v for k, v in search.items() if v}
    if search:
        write_line_chart(
            os.path.join(out, "optimizers_lr_search.svg"),
            search,
            title=f"{what}: validation loss after {st['grid_iters']} iterations at batch {st['batch']}",
            xlabel="log2 learning rate",
            ylabel="validation loss",
        )


def report(saved: dict, out) -> None:
    """Print the tables; with ``out`` also write ``optimizers_table.md`` and the charts there."""
    text = table(saved)
    st = saved["settings"]
    print(f"\n{text}\n\n(device: {st['device']}, torch {st['torch']}, {st.get('elapsed_s', 0):.0f} s)", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "optimizers_table.md"), "w") as f:
            f.write(text + "\n")
        charts(saved, out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=None, help="a quickstart_out/ (default: build the corpus in a temp dir)")
    p.add_argument("--out", default=None, help="write optimizers.json, the tables and the charts here")
    p.add_argument("--batch", type=int, default=16, help="the small global batch B")
    p.add_argument("--micro-batch", type=int, default=128, help="largest micro batch (more: gradient accumulation)")
    p.add_argument("--tokens", type=int, default=4 * 2**20, help="training tokens per full run (at most)")
    p.add_argument("--grid-iters", type=int, default=64, help="iterations at batch B per search run")
    p.add_argument("--grid-points", type=int, default=6, help="search only the first N learning rates of each grid")
    p.add_argument("--budget-s", type=float, default=270.0, help="fewer tokens if the runs would end after this")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    p.add_argument(
        "--cpu-smoke", action="store_true", help="on the CPU: a 2 x 64 model, 8 search iterations, 32 eval samples"
    )
    p.add_argument("--report", default=None, help="an optimizers.json: print its tables (and charts with --out)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.grid_iters = min(args.grid_iters, 8)
        args.tokens = min(args.tokens, EVALS * args.batch * FACTOR * SMOKE_MODEL["seq-length"])
        args.micro_batch = min(args.micro_batch, 16)
    if "adam" not in args.optimizers:
        p.error("--optimizers must include adam (the reference of every ratio)")
    samples = SMOKE_EVAL_SAMPLES if args.cpu_smoke else EVAL_SAMPLES
    if samples % (args.batch * FACTOR) or (args.batch * FACTOR) % min(args.batch * FACTOR, args.micro_batch):
        p.error(f"{samples} must be a multiple of {FACTOR} x --batch, and --micro-batch divide it")
    return args


def main() -> None:
    args = parse_args()
    if args.report:
        with open(args.report) as f:
            return report(json.load(f), args.out)
    if not args.out:
        raise SystemExit("bench/optimizers.py: --out is required (the JSON, tables and charts go there)")
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench_optimizers_")
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = os.path.join(tmp, "quickstart_out")
        os.makedirs(data_dir)
        build_corpus(data_dir)
    init_distributed(args.cpu_smoke)
    bench = Bench(args, data_dir, tmp)
    bench.search()
    bench.full_runs(bench.plan())
    bench.save()
    report(bench.saved, args.out)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

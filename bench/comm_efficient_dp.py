#!/usr/bin/env python
"""Communication-efficient data parallelism on the simulated cluster (DP 4 = 2 nodes x 2 ranks).

Every cell is one real training run through ``tools/cluster/run.py`` (network namespaces, inter-node
links shaped with ``tc``; needs root or CAP_NET_ADMIN) of ``pretrain_gpt.py`` with the quickstart's
model and training flags (4 layers, hidden 256, sequence 128, global batch 16 = 2048 tokens per
iteration, vocab 8192, ~5.3M parameters; bf16 with fp32 gradients, AdamW, cosine LR, clip 1.0),
``--log-interval 1`` into a metrics file, validation every ``--eval-interval`` iterations.

Cells: method x corpus x inter-node link x seed (``--seed``: weights and data order).

* methods (:data:`METHODS`): ``plain`` is plain DP (one flat all-reduce over the 4 ranks, overlapped
  with the backward), ``hierarchical`` adds ``--hierarchical-grad-reduce`` (exact intra-node legs, one
  inter-node all-reduce); every other method is hierarchical with its compression or local-SGD sync
  on the inter-node leg only;
* corpora (:data:`CORPORA`): ``quickstart`` (Python's standard library, ``examples/quickstart.sh``'s
  corpus) and ``system`` (man pages and license texts, ``bench/system_corpus.py``), each with its own
  8k sentencepiece tokenizer, built under ``--data-root`` on first use;
* ``--bandwidths`` (tc units, default ``100mbit,1gbit``), ``--seeds`` (default ``1234,1235``).

Every finished cell is appended to ``--results`` (JSON Lines: its curves, tokens/s, inter-node bytes,
the load average before and after it); cells already there are skipped, so a run that stopped resumes
and a finished one extends (more seeds, methods, iterations).  ``--report FILE ...`` prints, per
corpus and link, each method's tokens/s against plain and hierarchical DP of the same seed, its final
validation loss (equal tokens) against plain DP's, the gap's spread over seeds, and the verdict on
the goal (>= 3x plain DP at 100 Mbit/s within 2% on every corpus and seed, spread below the margin);
``--plot PREFIX`` draws validation loss against training time (matplotlib), one PNG per link.

Split measurement (``--speed-window N``, what the quiet grid uses): the loss does not depend on the
link (the same collectives, the same math), only the time does.  So each (corpus, seed, method) trains
its ``--iters`` iterations ONCE with no link limit (the *loss run*: curves, validation loss at equal
tokens; shared by every link), and each link gets a short *speed run* through the shaped link of
``--speed-warmup W`` + ``N`` + 1 iterations with the same learning-rate schedule (``--lr-decay-iters``
of the loss run), whose tokens/s and inter-node bytes are taken over iterations ``W+1 .. W+N`` (after
start-up, before the last iteration's blocking sync; ``N`` must be a multiple of every method's
synchronisation period H).  The equality claim is checked, not assumed: the speed run's training
losses must equal the loss run's over its iterations (recorded in the cell as ``loss_check``; the
report flags any difference).  ``--speed-only`` methods (default ``hierarchical``, a speed baseline)
get no loss run.  Then a plain-DP cell at 100 Mbit/s costs ~W+N+1 link-bound iterations, not 256.

    python3 bench/comm_efficient_dp.py --corpora quickstart --bandwidths 100mbit --results q.jsonl
    python3 bench/comm_efficient_dp.py --report q.jsonl s.jsonl --plot bench/results/comm_efficient_dp

The quiet grid (issue 35; see docs/comm-efficient-dp.md for its measured duration)::

    python3 bench/comm_efficient_dp.py --quiet-grid --results quiet.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from comm_efficient_report import report, verdict  # noqa: E402

TOKENS_PER_ITER = 16 * 128
MODEL = [  # examples/quickstart.sh's model and optimizer (bf16: its choice on CPUs with native bf16)
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--bf16", "--split", "98,1,1", "--tokenizer-type", "SentencePieceTokenizer",
    "--num-workers", "0", "--log-interval", "1", "--ddp-bucket-size", "500000", "--overlap-grad-reduce",
]  # fmt: skip
HIER = ["--hierarchical-grad-reduce"]
METHODS = {  # name: (label, flags)
    "plain": ("plain DP (flat all-reduce)", []),
    "hierarchical": ("hierarchical DP (exact)", HIER),
    "int8": ("int8 inter-node, hierarchical", HIER + ["--grad-compression", "int8"]),
    "int4": ("int4 inter-node, hierarchical", HIER + ["--grad-compression", "int4"]),
    "fp8": ("fp8 e4m3 inter-node, hierarchical", HIER + ["--grad-compression", "fp8"]),
    "powersgd": ("PowerSGD rank 4 inter-node", HIER + ["--grad-compression", "powersgd", "--powersgd-rank", "4"]),
    "powersgd32": ("PowerSGD rank 32 inter-node", HIER + ["--grad-compression", "powersgd", "--powersgd-rank", "32"]),
    "topk": ("top-k 1% inter-node", HIER + ["--grad-compression", "topk", "--topk-ratio", "0.01"]),
    "local_sgd_h8": ("local SGD H=8", HIER + ["--local-sgd-interval", "8"]),
    "local_sgd_h8_overlap1": ("local SGD H=8, overlapped 1 step", HIER + ["--local-sgd-interval", "8"]
                              + ["--local-sgd-overlap-steps", "1"]),
    "local_sgd_h4_overlap1": ("local SGD H=4, overlapped 1 step", HIER + ["--local-sgd-interval", "4"]
                              + ["--local-sgd-overlap-steps", "1"]),
    "diloco_h32": ("DiLoCo H=32 (lr 0.7, mom. 0.9)", HIER + ["--local-sgd-interval", "32", "--outer-lr", "0.7"]
                   + ["--outer-momentum", "0.9"]),
    # issue 35's literature variants (warm-ups of 32 exact / synchronous steps; split runs need --speed-warmup >= 32)
    "powersgd32_warm32": ("PowerSGD rank 32 inter-node, 32 exact steps first", HIER + ["--grad-compression",
                          "powersgd", "--powersgd-rank", "32", "--grad-compression-warmup-iters", "32"]),
    "diloco_h8_warm32": ("DiLoCo H=8, 32 synchronous steps first", HIER + ["--local-sgd-interval", "8", "--outer-lr",
                         "0.7", "--outer-momentum", "0.9", "--local-sgd-warmup-iters", "32"]),
    "streaming_h8_f4": ("Streaming DiLoCo H=8, 4 fragments, int8 outer grads, 32 sync. steps first", HIER + [
                        "--local-sgd-interval", "8", "--outer-lr", "0.7", "--outer-momentum", "0.9",
                        "--local-sgd-warmup-iters", "32", "--local-sgd-fragments", "4", "--local-sgd-overlap-steps",
                        "2", "--outer-grad-int8-chunk", "1024"]),
}  # fmt: skip
DEFAULT_METHODS = "plain,hierarchical,int8,local_sgd_h8_overlap1,fp8"
CORPORA = {  # name: (document prefix, the command that builds its JSON-lines text)
    "quickstart": ("stdlib_text_document", ["examples/build_stdlib_corpus.py", "--max-mb", "20"]),
    "system": ("system_text_document", ["bench/system_corpus.py", "--max-mb", "10"]),
}


QUIET_GRID = {  # --quiet-grid: issue 35's cells (the goal's link first, then 1 Gbit/s: its speed runs only)
    "methods": "plain,hierarchical,int8,int4",
    "corpora": "quickstart,system",
    "bandwidths": "100mbit,1gbit",
    "seeds": "1234,1235",
    "iters": 256,
    "speed_window": 16,
    "speed_warmup": 4,
    "speed_only": "hierarchical",
    "speed_seeds": 1,
}


class BenchInputError(Exception):
    """A method, corpus or results file the benchmark cannot use."""


def env() -> dict:
    """This checkout's megalm first (tools/ scripts run by path do not see the repository root)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def prepare_corpus(name: str, data_root: str) -> str:
    """The corpus' directory (``<prefix>.bin/.idx``, ``tokenizer.model``), built on first use."""
    prefix, builder = CORPORA[name]
    d = os.path.join(os.path.abspath(data_root), name)
    if os.path.exists(os.path.join(d, prefix + ".idx")) and os.path.exists(os.path.join(d, "tokenizer.model")):
        return d
    os.makedirs(d, exist_ok=True)
    steps = [
        [builder[0], "--output", "corpus.jsonl", *builder[1:]],
        ["tools/train_tokenizer.py", "--input", "corpus.jsonl", "--json-keys", "text", "--model-prefix", "tokenizer",
         "--vocab-size", "8192", "--model-type", "bpe", "--byte-fallback"],
        ["tools/preprocess_data.py", "--input", "corpus.jsonl", "--json-keys", "text", "--output-prefix",
         prefix[: -len("_text_document")], "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
         "tokenizer.model", "--append-eod", "--workers", "1", "--no-progress"],
    ]  # fmt: skip
    for step in steps:
        print(f"[{name}] {' '.join(step)}", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, step[0]), *step[1:]], cwd=d, env=env(), check=True)
    return d


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def cell_key(r: dict) -> tuple:
    return (r["corpus"], r["bandwidth"], r["seed"], r["method"], r["iters"])


def parse_metrics(rows, window=None) -> dict:
    """Curves and rates of one run's metrics rows (``pretrain_gpt.py --metrics-file``); tokens/s and
    bytes over every iteration but the first (it pays start-up), or over iterations ``lo < i <= hi``
    of ``window``."""
    train = [r for r in rows if r.get("lm_loss") is not None and "split" not in r]
    if not train:
        raise BenchInputError("the run logged no training iteration")
    later = train[1:] or train  # the first iteration pays start-up
    if window is not None:
        later = [r for r in train if window[0] < r["iteration"] <= window[1]]
        if len(later) != window[1] - window[0]:
            raise BenchInputError(f"the run logged {len(later)} of the window's {window[1] - window[0]} iterations")
    seconds = sum(r["elapsed_ms"] for r in later) / 1e3
    elapsed, curve, at = 0.0, [], {}
    for r in train:
        elapsed += r["elapsed_ms"] / 1e3
        curve.append((elapsed, r["lm_loss"]))
        at[r["iteration"]] = elapsed
    valid = [(r["iteration"] * TOKENS_PER_ITER, at[r["iteration"]], r["loss"]) for r in rows
             if r.get("split") == "validation" and r["iteration"] in at]  # fmt: skip
    return {
        "curve": curve,  # (training seconds, training loss) per iteration
        "valid": valid,  # (tokens, training seconds, validation loss) per evaluation
        "tokens_per_s": len(later) * TOKENS_PER_ITER / seconds,
        "inter_node_MB_per_step": max(sum(r.get("inter_node_bytes", 0) for r in later) / len(later) / 1e6, 0.0),
        "train_loss": train[-1]["lm_loss"],
        "losses": {r["iteration"]: r["lm_loss"] for r in train},
        "valid_loss": valid[-1][2] if valid else None,
    }


def run_cluster(
    corpus: str,
    data_dir: str,
    bandwidth: str,
    seed: int,
    method: str,
    args,
    tmp: str,
    iters: int,
    tag: str = "",
    extra=(),
) -> list:
    """One training run on the simulated cluster; its metrics rows.  ``iters``: --train-iters (the
    learning-rate schedule is always the one of ``args.iters`` iterations); ``extra``: more flags."""
    prefix = CORPORA[corpus][0]
    metrics = os.path.join(tmp, f"{corpus}_{bandwidth}_{seed}_{method}{tag}.jsonl")
    flags = MODEL + METHODS[method][1] + [
        "--data-path", os.path.join(data_dir, prefix), "--tokenizer-model", os.path.join(data_dir, "tokenizer.model"),
        "--seed", str(seed), "--train-iters", str(iters), "--lr-warmup-iters", str(min(20, args.iters // 2)),
        "--lr-decay-iters", str(args.iters), "--metrics-file", metrics, *extra,
    ]  # fmt: skip
    cmd = [sys.executable, os.path.join(ROOT, "tools", "cluster", "run.py"), "--nodes", "2", "--procs-per-node", "2",
           "--name", args.name, "--timeout", str(args.timeout)]  # fmt: skip
    if bandwidth != "unshaped":
        cmd += ["--inter-node-bandwidth", bandwidth]
    cmd += ["--", os.path.join(ROOT, "pretrain_gpt.py")] + flags
    done = subprocess.run(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method}: the cluster run exited {done.returncode}:\n{done.stdout[-3000:]}")
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def _evals(args) -> list:
    return ["--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters)]


def _host(started, load_before) -> dict:
    return {
        "started": started.isoformat(timespec="seconds"),
        "wall_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
        "load_before": list(load_before), "load_after": list(os.getloadavg()), "cpu": cpu_model(),
        "nproc": os.cpu_count(),
    }  # fmt: skip


def run_cell(corpus: str, data_dir: str, bandwidth: str, seed: int, method: str, args, tmp: str) -> dict:
    """A cell measured by one run of ``--iters`` iterations through the shaped link (loss and speed)."""
    load_before, started = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    rows = run_cluster(corpus, data_dir, bandwidth, seed, method, args, tmp, args.iters, extra=_evals(args))
    result = parse_metrics(rows)
    return {
        "corpus": corpus, "bandwidth": bandwidth, "seed": seed, "method": method, "iters": args.iters,
        "tokens_per_iter": TOKENS_PER_ITER, **_host(started, load_before), **result,
        "measured": f"loss and tokens/s: one run of {args.iters} iterations at {bandwidth}",
    }  # fmt: skip


def run_loss(corpus: str, data_dir: str, seed: int, method: str, args, tmp: str) -> dict:
    """The loss run of a (corpus, seed, method): ``--iters`` iterations with no link limit."""
    load_before, started = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    rows = run_cluster(corpus, data_dir, "unshaped", seed, method, args, tmp, args.iters, "_loss", _evals(args))
    return {
        "kind": "loss_run", "corpus": corpus, "seed": seed, "method": method, "iters": args.iters,
        **_host(started, load_before), **parse_metrics(rows),
    }  # fmt: skip


def _flag(method: str, flag: str, default: int) -> int:
    flags = METHODS[method][1]
    return int(flags[flags.index(flag) + 1]) if flag in flags else default


def period(method: str) -> int:
    """Iterations between a method's synchronisations (its --local-sgd-interval, else 1)."""
    return _flag(method, "--local-sgd-interval", 1)


def warmup(method: str) -> int:
    """A method's warm-up of exact / synchronous iterations (a speed window must start after it)."""
    return max(_flag(method, "--grad-compression-warmup-iters", 0), _flag(method, "--local-sgd-warmup-iters", 0))


def loss_check(speed_losses: dict, loss_run: dict) -> dict:
    """The speed run's training losses against the loss run's, iteration by iteration."""
    theirs = {int(k): v for k, v in loss_run["losses"].items()}
    common = sorted(i for i in speed_losses if i in theirs)
    diff = max((abs(speed_losses[i] - theirs[i]) / max(abs(theirs[i]), 1e-30) for i in common), default=None)
    return {"iterations": len(common), "max_rel_diff": diff, "equal": bool(common) and diff == 0.0}


def run_split_cell(corpus, data_dir, bandwidth, seed, method, args, tmp, loss_run, reuse=None) -> dict:
    """A cell of the split measurement (see the module): its speed run at ``bandwidth``, its loss
    from ``loss_run`` (None for a ``--speed-only`` method).  ``reuse``: the cell of an earlier seed
    (same corpus, link and method) whose speed run this one takes instead of running its own (the
    same model, batch and collectives: the seed changes the numbers, not the work)."""
    w, n = args.speed_warmup, args.speed_window
    load_before, started = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    if reuse is None:
        extra = ["--eval-iters", "0"]
        rows = run_cluster(corpus, data_dir, bandwidth, seed, method, args, tmp, w + n + 1, "_speed", extra)
        speed = parse_metrics(rows, window=(w, w + n))
        how = f"tokens/s: iterations {w + 1}-{w + n} of a {w + n + 1}-iteration run at {bandwidth}"
    else:
        speed = {k: reuse[k] for k in ("tokens_per_s", "inter_node_MB_per_step", "train_loss", "curve")}
        how = f"tokens/s: seed {reuse['seed']}'s speed run (iterations {w + 1}-{w + n} at {bandwidth})"
    cell = {
        "corpus": corpus, "bandwidth": bandwidth, "seed": seed, "method": method, "iters": args.iters,
        "tokens_per_iter": TOKENS_PER_ITER, **_host(started, load_before),
        "tokens_per_s": speed["tokens_per_s"], "inter_node_MB_per_step": speed["inter_node_MB_per_step"],
        "speed_window": [w + 1, w + n], "speed_of_seed": seed if reuse is None else reuse["seed"],
        "measured": how + "; " + (f"loss: a {args.iters}-iteration run with no link limit" if loss_run
                                  else "loss: not measured"),
    }  # fmt: skip
    if loss_run is None:
        return {**cell, "valid": [], "valid_loss": None, "train_loss": speed["train_loss"], "curve": speed["curve"]}
    out = {
        **cell, "valid": loss_run["valid"], "valid_loss": loss_run["valid_loss"], "train_loss": loss_run["train_loss"],
        "curve": loss_run["curve"], "unshaped_tokens_per_s": loss_run["tokens_per_s"],
    }  # fmt: skip
    if reuse is None:
        out["loss_check"] = loss_check(speed["losses"], loss_run)
    return out


def load_results(paths) -> list:
    records = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise BenchInputError(f"{path}:{n}: not a JSON line ({e}); a run killed mid-write?") from e
    return records


def check_names(given: str, known: dict, what: str) -> list:
    names = [n for n in given.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise BenchInputError(f"unknown {what} {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
    return names


def measure(args) -> None:
    """Every cell not yet in ``--results``: seeds outermost (the first seed's full table comes first);
    split (``--speed-window``), links outermost (the first link's cells, the goal's, are complete first;
    the later links add only their speed runs)."""
    methods = check_names(args.methods, METHODS, "method")
    corpora = check_names(args.corpora, CORPORA, "corpus")
    split = args.speed_window > 0
    speed_only = set(check_names(args.speed_only, METHODS, "method")) if split and args.speed_only else set()
    if split:
        bad = [f"{m} (H={period(m)})" for m in methods if args.speed_window % period(m)]
        if bad or args.speed_warmup < 1:
            raise BenchInputError(
                f"--speed-window {args.speed_window} must be a multiple of every method's period H (not of "
                f"{', '.join(bad)}) and --speed-warmup >= 1 (got {args.speed_warmup})"
            )
        early = [f"{m} ({warmup(m)})" for m in methods if args.speed_warmup < warmup(m)]
        if early:
            raise BenchInputError(
                f"--speed-warmup {args.speed_warmup} ends inside the warm-up of {', '.join(early)}: the window "
                "would time the exact steps, not the method"
            )
    records = load_results([args.results])
    done = {cell_key(r) for r in records if r.get("kind") != "loss_run"}
    losses = {(r["corpus"], r["seed"], r["method"], r["iters"]): r for r in records if r.get("kind") == "loss_run"}
    seeds = [int(s) for s in args.seeds.split(",")]
    measured_speed = {  # (corpus, link, method, iters): the cell of the seed whose speed run the later ones reuse
        (r["corpus"], r["bandwidth"], r["method"], r["iters"]): r
        for r in records if r.get("speed_of_seed") == r["seed"] and r["seed"] in seeds[: args.speed_seeds]
    }  # fmt: skip
    dirs = {c: prepare_corpus(c, args.data_root) for c in corpora}

    def append(r):
        with open(args.results, "a") as f:
            f.write(json.dumps(r) + "\n")

    with tempfile.TemporaryDirectory(prefix="megalm-comp-bench-") as tmp:
        os.chmod(tmp, 0o777)
        links = args.bandwidths.split(",")
        order = [(seed, link) for link in links for seed in seeds] if split else [(s, b) for s in seeds for b in links]
        for seed, bandwidth in order:
            for corpus in corpora:
                for method in methods:
                    key = (corpus, bandwidth, seed, method, args.iters)
                    if key in done:
                        continue
                    if not split:
                        r = run_cell(corpus, dirs[corpus], bandwidth, seed, method, args, tmp)
                    else:
                        lkey = (corpus, seed, method, args.iters)
                        if method not in speed_only and lkey not in losses:
                            losses[lkey] = run_loss(corpus, dirs[corpus], seed, method, args, tmp)
                            append(losses[lkey])
                        skey = (corpus, bandwidth, method, args.iters)
                        later = args.speed_seeds and seed not in seeds[: args.speed_seeds]
                        reuse = measured_speed.get(skey) if later else None
                        loss_run = losses.get(lkey) if method not in speed_only else None
                        r = run_split_cell(corpus, dirs[corpus], bandwidth, seed, method, args, tmp, loss_run, reuse)
                        measured_speed.setdefault(skey, r)
                    append(r)
                    check = r.get("loss_check")
                    same = "" if check is None else f", losses equal the loss run's: {check['equal']}"
                    print(f"{corpus} {bandwidth} seed {seed} {method}: {r['tokens_per_s']:.0f} tokens/s, "
                          f"valid {r['valid_loss']}, load {r['load_before'][0]:.1f}-{r['load_after'][0]:.1f}"
                          f"{same}", flush=True)  # fmt: skip


def plot(records, prefix: str) -> list:
    """Validation loss against training seconds, one PNG per link (a panel per corpus, the longest runs);
    the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    records = [r for r in records if r.get("kind") != "loss_run" and r.get("valid")]  # cells with a loss curve
    for bandwidth in sorted({r["bandwidth"] for r in records}):
        rows = [r for r in records if r["bandwidth"] == bandwidth]
        rows = [r for r in rows if r["iters"] == max(x["iters"] for x in rows)]  # the longest runs only
        corpora = sorted({r["corpus"] for r in rows})
        fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4.5), squeeze=False)
        for ax, corpus in zip(axes[0], corpora):
            for i, method in enumerate(m for m in METHODS if any(r["method"] == m for r in rows)):
                for j, r in enumerate(r for r in rows if r["corpus"] == corpus and r["method"] == method):
                    if "speed_window" in r:  # split: the loss run's tokens at the speed run's rate
                        t = [tokens / r["tokens_per_s"] for tokens, _, _ in r["valid"]]
                    else:  # from the end of the first iteration
                        t = [s - r["curve"][0][0] for _, s, _ in r["valid"]]
                    loss = [v for _, _, v in r["valid"]]
                    ax.plot(t, loss, color=f"C{i}", linestyle="-" if j == 0 else "--", marker=".",
                            label=f"{METHODS[method][0]}" if j == 0 else None)  # fmt: skip
            ax.set_title(f"{corpus} corpus, {bandwidth} between nodes (dashed: 2nd seed)")
            ax.set_xlabel("training seconds (split cells: tokens / the speed run's tokens/s; evaluations excluded)")
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{prefix}_{bandwidth}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default="comm_efficient_dp.jsonl", help="JSON Lines of finished cells (appended)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, of: {', '.join(METHODS)}")
    p.add_argument("--corpora", default="quickstart,system", help=f"comma-separated, of: {', '.join(CORPORA)}")
    p.add_argument("--data-root", default="comm_bench_data", help="corpora are built (once) under DIR/<corpus>")
    p.add_argument("--bandwidths", default="100mbit,1gbit", help="inter-node link rates (tc units) or 'unshaped'")
    p.add_argument("--seeds", default="1234,1235", help="comma-separated --seed values")
    p.add_argument("--iters", type=int, default=256, help="training iterations per cell")
    p.add_argument("--eval-interval", type=int, default=32, help="iterations between validations")
    p.add_argument("--eval-iters", type=int, default=4, help="validation batches per evaluation")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per cluster run")
    p.add_argument("--name", default="mlccomp", help="cluster name (tools/cluster/run.py --name; one per process)")
    p.add_argument(
        "--speed-window",
        type=int,
        default=0,
        help="split measurement: loss from one unshaped run of --iters, tokens/s over this many "
        "iterations of a short shaped run (0: one shaped run of --iters per cell)",
    )
    p.add_argument("--speed-warmup", type=int, default=8, help="speed-run iterations before the window")
    p.add_argument(
        "--speed-seeds",
        type=int,
        default=0,
        help="split measurement: speed runs for the first this many --seeds only, later seeds' cells take "
        "the first seed's tokens/s (the same work); 0: every seed",
    )
    p.add_argument("--speed-only", default="hierarchical", help="methods with no loss run (split measurement)")
    p.add_argument(
        "--quiet-grid",
        action="store_true",
        help="issue 35's grid (explicit flags override): " + ", ".join(f"{k} {v}" for k, v in QUIET_GRID.items()),
    )
    p.add_argument("--report", nargs="+", metavar="FILE", help="no runs: the table of these --results files")
    p.add_argument("--plot", metavar="PREFIX", help="with --report: write PREFIX_<link>.png")
    args = p.parse_args(argv)
    if args.quiet_grid:  # the grid's values as defaults: flags given explicitly still win
        p.set_defaults(**QUIET_GRID)
        args = p.parse_args(argv)
    try:
        if not args.report:
            measure(args)
            return 0
        records = load_results(args.report)
        print(report(records, METHODS))
        print(verdict(records, METHODS))
        if args.plot:
            print("plots:", ", ".join(plot(records, args.plot)))
    except BenchInputError as e:
        print(f"comm_efficient_dp: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

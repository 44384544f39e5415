#!/usr/bin/env python
"""The planner's predictions against real training runs on the simulated cluster (``tools/cluster/run.py``).

Two steps, each writing JSON under ``bench/results/``:

* ``measure``: every layout of :data:`RUNS` (a dense ~1.9M-parameter GPT and a 4-expert top-2 MoE of it;
  2 and 4 nodes x 2 processes; 1 Gbit/s and 100 Mbit/s inter-node links) is one short real training run
  (``pretrain_gpt.py`` on mock data, ``--train-iters ITERS``); kept per run: the median step time of the
  iterations after the first, the peak RSS of every rank (the trainer's ``memory per rank`` log line), the
  host's load average before and after;
* ``calibrate``: ``tools/plan.py --calibrate`` on each simulated cluster of the runs (nodes, link rate) into
  ``bench/results/planner_sim_<nodes>x2_<rate>.toml``;
* ``report``: predicts each run's step time and peak memory per rank with :mod:`megalm.planner` on its
  calibrated cluster from the very flags the run used, and prints predicted vs measured (MAPE, Spearman's rho,
  whether the
  planner's first choice among the measured layouts is within 5% of the measured fastest).

    python3 bench/planner_validation.py measure [--iters 6] [--only NAME,...]
    python3 bench/planner_validation.py calibrate      # bench/results/planner_sim_<nodes>x2_<rate>.toml
    python3 bench/planner_validation.py refit          # bench/results/planner_refit.json
    python3 bench/planner_validation.py report [--fit bench/results/planner_refit.json] [--json ...]
    python3 bench/planner_validation.py plot --json A.json [B.json ...] --out bench/results/planner_validation.png

* ``refit``: three cluster keys the calibration does not measure under a training run's load fitted to the
  measured runs by a grid search for the least MAPE (one value for every run and cluster), with the
  leave-one-out MAPE (each run predicted by the fit of the others: the error to expect on a run the fit has not
  seen): ``latency_us_per_process`` (a ring step's latency is a woken process's wait for a core, which grows
  with the processes per core: :func:`fitted`), ``collective_call_us`` (a collective call's fixed cost),
  ``optimizer_ns_per_param``; writes ``bench/results/planner_refit.json`` and the refit cluster files
  ``planner_sim_<nodes>x2_<rate>_refit.toml`` (for ``tools/plan.py --cluster``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, ROOT)
from cluster_training import MODEL  # noqa: E402

# measured on a quiet host (load < 2 before the runs); planner_validation_measured_loaded.json: the same runs
# at load 13-70, kept for the record
MEASURED = os.path.join(ROOT, "bench", "results", "planner_validation_measured_quiet.json")
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
TP = lambda n: ["--tensor-model-parallel-size", str(n)]  # noqa: E731
PP = lambda n: ["--pipeline-model-parallel-size", str(n)]  # noqa: E731
EP = lambda n: ["--expert-model-parallel-size", str(n)]  # noqa: E731
CP = lambda n: ["--context-parallel-size", str(n)]  # noqa: E731
DISTOPT = ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim", "--overlap-param-gather"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

# (name, model, nodes, inter-node rate, layout flags); processes per node: 2; global batch 4 x nodes.
RUNS = [
    ("dp4", "dense", 2, "1gbit", []),
    ("dp4_hier", "dense", 2, "1gbit", ["--hierarchical-grad-reduce"]),
    ("dp4_distopt", "dense", 2, "1gbit", ["--use-distributed-optimizer"]),
    ("dp4_mb1", "dense", 2, "1gbit", ["--micro-batch-size", "1"]),
    ("tp2_dp2", "dense", 2, "1gbit", TP(2)),
    ("tp2_dp2_sp", "dense", 2, "1gbit", TP(2) + ["--sequence-parallel"]),
    ("tp4", "dense", 2, "1gbit", TP(4)),
    ("pp2_dp2", "dense", 2, "1gbit", PP(2)),
    ("tp2_pp2", "dense", 2, "1gbit", TP(2) + PP(2)),
    ("tp2_pp2_recompute", "dense", 2, "1gbit", TP(2) + PP(2) + RECOMPUTE),
    ("pp4", "dense", 2, "1gbit", PP(4)),
    ("cp2_dp2", "dense", 2, "1gbit", CP(2)),
    ("dp4", "dense", 2, "100mbit", []),
    ("dp4_hier", "dense", 2, "100mbit", ["--hierarchical-grad-reduce"]),
    ("tp2_dp2", "dense", 2, "100mbit", TP(2)),
    ("tp4", "dense", 2, "100mbit", TP(4)),
    ("tp2_pp2", "dense", 2, "100mbit", TP(2) + PP(2)),
    ("pp2_dp2", "dense", 2, "100mbit", PP(2)),
    ("dp8", "dense", 4, "1gbit", []),
    ("tp2_dp4", "dense", 4, "1gbit", TP(2)),
    ("tp2_pp2_dp2", "dense", 4, "1gbit", TP(2) + PP(2)),
    ("dp8", "dense", 4, "100mbit", []),
    ("tp2_pp2_dp2", "dense", 4, "100mbit", TP(2) + PP(2)),
    ("moe_dp4", "moe", 2, "1gbit", []),
    ("moe_ep2", "moe", 2, "1gbit", EP(2)),
    ("moe_ep4", "moe", 2, "1gbit", EP(4)),
    ("moe_tp2_ep2", "moe", 2, "1gbit", TP(2) + EP(2) + ["--sequence-parallel"]),
    ("moe_ep4", "moe", 2, "100mbit", EP(4)),
    ("moe_ep2", "moe", 2, "100mbit", EP(2)),
    ("moe_dp4", "moe", 2, "100mbit", []),
    # the planner's first choice of a full search (tools/plan.py on the calibrated cluster file), measured
    ("plan_top1", "dense", 2, "1gbit", DISTOPT + ["--hierarchical-grad-reduce"]),
    ("plan_top1", "dense", 2, "100mbit", TP(2) + DISTOPT + ["--hierarchical-grad-reduce"]),
    # to measure (quiet host): the first choice of the full search with today's model on the refit cluster files
    # (tools/plan.py <the model> --cluster bench/results/planner_sim_<nodes>x2_<rate>_refit.toml), and two
    # layouts of cost terms no run above has (the alltoall dispatcher, interleaved stages)
    ("plan2_top1", "dense", 2, "1gbit", TP(2) + PP(2) + ["--micro-batch-size", "8"]),
    ("plan2_top1", "dense", 2, "100mbit", PP(4) + ["--micro-batch-size", "4"]),
    ("plan2_top1", "dense", 4, "1gbit", ["--hierarchical-grad-reduce"]),
    ("plan2_top1", "dense", 4, "100mbit", TP(2) + PP(4) + ["--sequence-parallel", "--micro-batch-size", "8"]),
    ("moe_plan2_top1", "moe", 2, "1gbit", PP(4) + ["--micro-batch-size", "4"]),
    ("moe_plan2_top1", "moe", 2, "100mbit", PP(4) + ["--micro-batch-size", "4"]),
    ("moe_ep4_a2a", "moe", 2, "1gbit", EP(4) + ["--moe-token-dispatcher-type", "alltoall"]),
    ("pp2_vpp2_dp2", "dense", 2, "1gbit", PP(2) + ["--num-virtual-stages-per-pipeline-rank", "2"]),
]


def run_key(name: str, nodes: int, rate: str) -> str:
    return f"{name}@{nodes}x2@{rate}"


def training_flags(model: str, nodes: int, layout: list, iters: int) -> list:
    """pretrain_gpt.py's flags of one run (the model, the global batch, the layout)."""
    flags = list(MODEL) + (MOE if model == "moe" else []) + ["--global-batch-size", str(4 * nodes)]
    return flags + ["--train-iters", str(iters)] + layout


def measure_one(key, model, nodes, rate, layout, iters, tmp, timeout) -> dict:
    metrics = os.path.join(tmp, re.sub(r"[^a-z0-9_]", "_", key) + ".jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "cluster", "run.py"), "--nodes", str(nodes)]
    cmd += ["--procs-per-node", "2", "--name", "mlcplan", "--timeout", str(timeout)]
    cmd += ["--inter-node-bandwidth", rate, "--", os.path.join(ROOT, "pretrain_gpt.py")]
    flags = training_flags(model, nodes, layout, iters)
    load = os.getloadavg()[0]
    t0 = time.time()
    done = subprocess.run(cmd + flags + ["--metrics-file", metrics], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{key}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    recs = [json.loads(line) for line in open(metrics) if '"lm_loss"' in line]
    mem = re.search(r"memory per rank \(peak RSS, MB\): (.*)", done.stdout)
    peaks = [float(x) * 2**20 for x in re.findall(r"rank \d+: (\d+)", mem.group(1))] if mem else []
    steps = [r["elapsed_ms"] / 1e3 for r in recs[1:]]
    return {
        "key": key,
        "model": model,
        "nodes": nodes,
        "rate": rate,
        "flags": flags,
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "peak_rss_bytes": peaks,
        "load_before": load,
        "load_after": os.getloadavg()[0],
        "wall_s": time.time() - t0,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def measure(args) -> int:
    results = {}
    if os.path.exists(args.out):
        results = json.load(open(args.out))
    only = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory(prefix="megalm-planner-val-") as tmp:
        os.chmod(tmp, 0o777)
        for name, model, nodes, rate, layout in RUNS:
            key = run_key(name, nodes, rate)
            if (only and name not in only and key not in only) or (key in results and not args.redo):
                continue
            try:
                results[key] = measure_one(key, model, nodes, rate, layout, args.iters, tmp, args.timeout)
            except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as e:
                print(f"FAILED {e}", file=sys.stderr, flush=True)
                continue
            r = results[key]
            print(f"{key}: {r['step_s'] * 1e3:.0f} ms, load {r['load_before']:.1f}", file=sys.stderr, flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="run the layouts on the simulated cluster")
    m.add_argument("--iters", type=int, default=6)
    m.add_argument("--only", help="comma-separated run names or keys")
    m.add_argument("--redo", action="store_true", help="measure again runs already in --out")
    m.add_argument("--timeout", type=float, default=400.0)
    m.add_argument("--out", default=MEASURED)
    c = sub.add_parser("calibrate", help="calibrate every simulated cluster the runs use")
    c.add_argument("--only", help="comma-separated NODESxRATE, e.g. 2x1gbit")
    r = sub.add_parser("report", help="predict the measured runs and compare")
    r.add_argument("--measured", default=MEASURED)
    r.add_argument("--json", help="write the table here")
    r.add_argument("--fit", help="a refit's JSON: its keys override the calibrated cluster files")
    f = sub.add_parser("refit", help="fit the uncalibrated keys to the measured runs")
    f.add_argument("--measured", default=MEASURED)
    f.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "planner_refit.json"))
    g = sub.add_parser("plot", help="predicted vs measured step time (PNG; needs matplotlib)")
    g.add_argument("--json", nargs="+", required=True, help="report --json files, one series each")
    g.add_argument("--label", nargs="+", help="a legend label per --json file")
    g.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "planner_validation.png"))
    args = p.parse_args(argv)
    if args.cmd == "measure":
        return measure(args)
    if args.cmd == "calibrate":
        return calibrate(args)
    if args.cmd == "refit":
        return refit(args)
    if args.cmd == "plot":
        return plot(args)
    return report(args)


def calibrate(args) -> int:
    only = set(args.only.split(",")) if args.only else None
    for nodes, rate in sorted({(n, r) for _, _, n, r, _ in RUNS}):
        if only and f"{nodes}x{rate}" not in only:
            continue
        cmd = [sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--cluster", cluster_file(nodes, rate)]
        cmd += ["--calibrate", "--nodes", str(nodes), "--devices-per-node", "2", "--inter-node-rate", rate]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        line = next(
            (x for x in done.stdout.splitlines() if "CALIBRATED" in x), done.stdout[-2000:] + done.stderr[-2000:]
        )
        print(f"{nodes}x2 {rate} (load {os.getloadavg()[0]:.1f}): {line}", file=sys.stderr, flush=True)
    return 0


def cluster_file(nodes: int, rate: str) -> str:
    return os.path.join(ROOT, "bench", "results", f"planner_sim_{nodes}x2_{rate}.toml")


def run_config(flags: list, nodes: int):
    from megalm.config import parse_config, with_vocab_size

    return with_vocab_size(parse_config(flags, world_size=nodes * 2), 8192 + 1)  # NullTokenizer: --vocab-size + 1


def predict(flags: list, nodes: int, rate: str, fit: dict = None) -> dict:
    """The planner's step time and largest-rank bytes for one run's flags on its calibrated cluster (with the
    ``fit``'s keys, when given)."""
    from megalm.planner.cluster import load_cluster
    from megalm.planner.cost import step_cost
    from megalm.planner.search import largest_rank_bytes

    cluster = fitted(load_cluster(cluster_file(nodes, rate)), fit)
    cfg = run_config(flags, nodes)
    cost = step_cost(cfg, cluster)
    return {
        "step_s": cost.step_s,
        "dominant": cost.dominant,
        "terms": cost.terms,
        "memory": largest_rank_bytes(cfg, cluster),
    }


FIT_KEYS = ("latency_us_per_process", "collective_call_us", "optimizer_ns_per_param")
FIT_GRID = {
    "latency_us_per_process": [100.0 * i for i in range(3, 13)],
    "collective_call_us": [0.0, 250.0, 500.0, 1000.0, 2000.0],
    "optimizer_ns_per_param": [2.0, 4.0, 8.0, 16.0, 36.0],
}
HOST_CORES = 2  # the measuring host's cores (AMD EPYC, 2 cores): every simulated node's processes share them


def fitted(cluster, fit: dict = None):
    """``cluster`` with a refit's keys.  ``latency_us_per_process``: a ring step's latency on the simulated
    cluster, intra- and inter-node alike, is the wait of the process woken by its data for a core: it grows with
    the busy processes per core (``world / HOST_CORES``); the calibration's 2-rank latency, timed with the
    other ranks idle, does not see it."""
    import dataclasses

    if not fit:
        return cluster
    values = {k: fit[k] for k in FIT_KEYS if k in fit and k != "latency_us_per_process"}
    if "latency_us_per_process" in fit:
        lat = fit["latency_us_per_process"] * cluster.world_size / HOST_CORES
        values |= {"intra_node_latency_us": lat, "inter_node_latency_us": lat}
    return dataclasses.replace(cluster, **values)


def refit(args) -> int:
    """Grid search of :data:`FIT_KEYS` for the least MAPE over the measured runs, and the leave-one-out MAPE."""
    import itertools

    from megalm.planner.cluster import load_cluster
    from megalm.planner.cost import step_cost

    measured = json.load(open(args.measured))
    runs = [
        (run_config(r["flags"], r["nodes"]), load_cluster(cluster_file(r["nodes"], r["rate"])), r["step_s"])
        for r in measured.values()
    ]
    grid = list(itertools.product(*(FIT_GRID[k] for k in FIT_KEYS)))
    errors = {}  # grid point -> absolute relative error per run
    for point in grid:
        values = dict(zip(FIT_KEYS, point))
        errors[point] = [abs(step_cost(cfg, fitted(c, values)).step_s / m - 1) for cfg, c, m in runs]
    best = min(grid, key=lambda g: sum(errors[g]))
    held_out = []
    for i in range(len(runs)):  # each run predicted by the fit of the others
        point = min(grid, key=lambda g: sum(errors[g]) - errors[g][i])
        held_out.append(errors[point][i])
    base = [abs(step_cost(cfg, c).step_s / m - 1) for cfg, c, m in runs]
    out = dict(zip(FIT_KEYS, best)) | {
        "mape_in_sample": statistics.mean(errors[best]),
        "mape_leave_one_out": statistics.mean(held_out),
        "mape_calibrated_only": statistics.mean(base),
        "runs": len(runs),
        "grid": FIT_GRID,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(out))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    from megalm.planner.cluster import dump_cluster

    for nodes, rate in sorted({(r["nodes"], r["rate"]) for r in measured.values()}):
        path = cluster_file(nodes, rate).replace(".toml", "_refit.toml")  # for tools/plan.py --cluster
        with open(path, "w") as f:
            f.write(dump_cluster(fitted(load_cluster(cluster_file(nodes, rate)), out)))
    return 0


def plot(args) -> int:
    """Predicted against measured step time, log-log: the diagonal and the +-15% band; one marker per series
    (a report's JSON), one colour per model and link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 8.5))
    colours = {}
    markers = ["o", "x", "s", "^"]
    labels = args.label or [os.path.basename(p) for p in args.json]
    lo, hi = float("inf"), 0.0
    for i, (path, label) in enumerate(zip(args.json, labels)):
        data = json.load(open(path))
        summary = data["summary"]
        for r in data["rows"]:
            group = f"{r['model']} {r['nodes']}x2 {r['rate']}"
            colour = colours.setdefault(group, f"C{len(colours)}")
            meas, pred = r["step_s"] * 1e3, r["pred"]["step_s"] * 1e3
            lo, hi = min(lo, meas, pred), max(hi, meas, pred)
            ax.scatter(meas, pred, color=colour, marker=markers[i % len(markers)], s=36)
        ax.scatter([], [], color="k", marker=markers[i % len(markers)],
                   label=f"{label}: MAPE {summary['mape']:.0%}, Spearman {summary['spearman_all']:.2f}")  # fmt: skip
    for group, colour in colours.items():
        ax.scatter([], [], color=colour, marker="s", label=group)
    line = [lo * 0.8, hi * 1.25]
    ax.plot(line, line, "k-", lw=0.8)
    ax.fill_between(
        line, [x * 0.85 for x in line], [x * 1.15 for x in line], color="0.85", label="within 15%", zorder=0
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms, median of 5 iterations)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("megalm-plan on the simulated cluster (2/4 nodes x 2 processes, gloo)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


def spearman(a: list, b: list) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else float("nan")


def report(args) -> int:
    measured = json.load(open(args.measured))
    fit = json.load(open(args.fit)) if args.fit else None
    rows = []
    for key, r in measured.items():
        p = predict(r["flags"], r["nodes"], r["rate"], fit)
        mem = max(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else float("nan")
        rows.append(r | {"pred": p, "mem": mem})
    print(
        "| run | model | nodes x procs | link | measured ms | predicted ms | error | dominant | "
        "peak RSS MB (max rank) | predicted MB | error | load avg |"
    )
    print("|" + "---|" * 12)
    for r in rows:
        e = r["pred"]["step_s"] / r["step_s"] - 1
        me = r["pred"]["memory"] / r["mem"] - 1
        print(
            f"| {r['key'].split('@')[0]} | {r['model']} | {r['nodes']}x2 | {r['rate']} | {r['step_s'] * 1e3:.0f} | "
            f"{r['pred']['step_s'] * 1e3:.0f} | {e:+.0%} | {r['pred']['dominant']} | {r['mem'] / 2**20:.0f} | "
            f"{r['pred']['memory'] / 2**20:.0f} | {me:+.0%} | {r['load_before']:.1f} |"
        )
    errors = [abs(r["pred"]["step_s"] / r["step_s"] - 1) for r in rows]
    mem_errors = [abs(r["pred"]["memory"] / r["mem"] - 1) for r in rows if r["mem"] == r["mem"]]
    print()
    print(
        f"step time: MAPE {statistics.mean(errors):.1%} over {len(rows)} runs; "
        f"memory: mean error {statistics.mean(mem_errors):.1%}, worst {max(mem_errors):.1%}"
    )
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["nodes"], r["rate"]), []).append(r)
    summary = {"mape": statistics.mean(errors), "memory_mean_error": statistics.mean(mem_errors), "groups": []}
    for (model, nodes, rate), g in sorted(groups.items()):
        meas = [r["step_s"] for r in g]
        pred = [r["pred"]["step_s"] for r in g]
        rho = spearman(meas, pred)
        pick = min(g, key=lambda r: r["pred"]["step_s"])
        fastest = min(g, key=lambda r: r["step_s"])
        gap = pick["step_s"] / fastest["step_s"] - 1
        print(
            f"{model} {nodes}x2 {rate}: {len(g)} layouts, Spearman {rho:.2f}, MAPE "
            f"{statistics.mean(abs(p / m - 1) for p, m in zip(pred, meas)):.0%}, planner's pick "
            f"{pick['key'].split('@')[0]} measured {gap:+.0%} vs the fastest ({fastest['key'].split('@')[0]})"
        )
        summary["groups"].append(
            {
                "model": model,
                "nodes": nodes,
                "rate": rate,
                "n": len(g),
                "spearman": rho,
                "pick": pick["key"],
                "fastest": fastest["key"],
                "pick_gap": gap,
            }
        )
    allm = [r["step_s"] for r in rows]
    allp = [r["pred"]["step_s"] for r in rows]
    summary["spearman_all"] = spearman(allm, allp)
    # the bar's Spearman: within each cluster group (one model, nodes, link: the layouts the planner chooses
    # among) with at least 5 layouts; in a group of 2-4 one swap of two close layouts moves it by 0.4-2
    ranked = [g for g in summary["groups"] if g["n"] >= 5]
    summary["spearman_groups_min"] = min((g["spearman"] for g in ranked), default=float("nan"))
    print(
        f"all runs: Spearman {summary['spearman_all']:.2f}; within groups of >= 5 layouts: "
        + ", ".join(f"{g['model']} {g['nodes']}x2 {g['rate']} {g['spearman']:.2f}" for g in ranked)
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""One-GPU training throughput: megalm vs megatron-core vs torchtitan vs plain PyTorch, in one run.

Every row is its own worker process (its own imports, CUDA context, peak memory); the rows of a
shape run in groups of ``--live`` workers alive at once, and inside a group the workers take turns
(rotating order, one computing at a time): ``--warmup`` untimed steps each (torch.compile's
compiles), then ``--rounds`` blocks of ``--steps`` timed steps.  Same shape, same micro-batch, same
random tokens, AdamW (lr 1e-5, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices), global-norm
clipping at 1.0, bf16 (``--precision``).  Rows (``--rows``, in this order; a row whose library or
Transformer Engine does not import is skipped with a one-line message):

  megalm-local        megalm --transformer-impl local, fusions on (its torch.compile'd kernels)
  plain-eager         nanoGPT-style PyTorch, causal SDPA, autocast bf16, fused AdamW
  mcore-local         megatron-core GPTModel, local spec, Megatron's Float16Module/DDP/optimizer
  titan-eager         torchtitan Llama3Model (FlexAttention), this loop   (llama shapes only)
  plain-compile       plain-eager under torch.compile(model)
  titan-compile       titan-eager with each block compiled, as torchtitan does
  megalm-te           megalm --transformer-impl transformer_engine, fusions on   (needs TE)
  mcore-te            megatron-core, TE spec                                      (needs TE)
  megalm-local-nofuse megalm local, every --no-*-fusion (no torch.compile)

Each row: tokens/s (micro-batch x seq / median step time), MFU by megalm's formula
(megalm/flops.py, which is Megatron-LM's; so also megatron-core's own) over megalm's device peak,
torchtitan's own MFU (its ``get_nparams_and_flops``) for titan rows, peak memory (CUDA
``max_memory_allocated``; CPU ``ru_maxrss``), parameters (asserted equal within a shape), first and
last loss.  Each row is printed when its group finishes and the JSON (``--out DIR``) is rewritten
after every group; groups run in priority order (the first group of every shape, then the second...)
and ``--budget-s`` stops starting groups (and rounds) when the time is spent.

    python bench/gpu_compare.py --out bench/results/gpu_compare          # GPU: llama1b, gpt3-1.3b
    python bench/gpu_compare.py --shapes tiny --precision fp32 --out /tmp/g   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

BENCH = os.path.abspath(os.path.dirname(__file__))
REPO = os.path.dirname(BENCH)
for _path in (REPO, BENCH):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from json_worker import JsonWorker  # noqa: E402

SHAPES = {
    "tiny": dict(arch="llama", layers=2, hidden=128, heads=4, groups=2, ffn=352, seq=128, vocab=1024, micro_batch=2),
    "tiny-gpt": dict(arch="gpt", layers=2, hidden=128, heads=4, groups=4, ffn=512, seq=128, vocab=1024, micro_batch=2),
    "llama1b": dict(
        arch="llama", layers=16, hidden=2048, heads=16, groups=8, ffn=8192, seq=2048, vocab=32768, micro_batch=4
    ),
    "gpt3-1.3b": dict(
        arch="gpt", layers=24, hidden=2048, heads=16, groups=16, ffn=8192, seq=2048, vocab=50304, micro_batch=4
    ),
}
# name: (impl, transformer impl, compiled / fusions on)
ROWS = {
    "megalm-local": ("megalm", "local", True),
    "plain-eager": ("plain", "local", False),
    "mcore-local": ("mcore", "local", False),
    "titan-eager": ("titan", "local", False),
    "plain-compile": ("plain", "local", True),
    "titan-compile": ("titan", "local", True),
    "megalm-te": ("megalm", "transformer_engine", True),
    "mcore-te": ("mcore", "transformer_engine", False),
    "megalm-local-nofuse": ("megalm", "local", False),
}
LIBRARY = {"megalm": "megalm", "plain": "torch", "mcore": "megatron-core", "titan": "torchtitan"}


class Worker(JsonWorker):
    """One row's worker process (``--_worker``), its thread count and imports of its own."""

    def __init__(self, name: str, spec: dict, log_dir: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, BENCH, os.environ.get("PYTHONPATH", "")]))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        super().__init__(name, __file__, spec, log_dir, env=env, cwd=REPO, close_timeout=60.0)


def worker_main(spec_json: str) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints go to the log
    spec = json.loads(spec_json)

    def send(msg):
        proto.write(json.dumps(msg) + "\n")

    try:
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(spec["threads"])
        from gpu_compare_runners import Runner

        runner = Runner(spec["row"], spec["shape"])
        cuda = runner.device.type == "cuda"
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "build":
                t0 = time.perf_counter()
                n = runner.build()
                if not cuda:  # megalm's start-up sets threads from the core count
                    torch.set_num_threads(spec["threads"])
                send({"params": n, "setup_s": time.perf_counter() - t0, "path": runner.path,
                      "own_flops_per_step": runner.own_flops_per_step})  # fmt: skip
            elif cmd["cmd"] == "run":
                times, cpu, losses = [], [], []
                for _ in range(cmd["steps"]):
                    c0, t0 = time.process_time(), time.perf_counter()
                    loss = runner.step()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    losses.append(loss)
                losses = [float(x) if x is not None else None for x in losses]
                send({"times": times, "cpu_times": cpu, "losses": losses})
            elif cmd["cmd"] == "stats":
                if cuda:
                    send({"peak_bytes": torch.cuda.max_memory_allocated(), "peak_kind": "cuda max_memory_allocated"})
                else:
                    send({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "peak_kind": "cpu ru_maxrss"})  # fmt: skip
            elif cmd["cmd"] == "exit":
                send({"bye": True})
                return
    except BaseException as e:  # noqa: BLE001 - report to the parent, then die
        import traceback

        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1)


def skip_reason(name: str, shape: dict) -> str | None:
    from gpu_compare_runners import peer_import_error

    impl, te_impl, _ = ROWS[name]
    if impl == "titan" and shape["arch"] != "llama":
        return "torchtitan has no GPT-3 (LayerNorm, GELU, learned positions) model"
    err = peer_import_error(impl, te=te_impl == "transformer_engine")
    if err:
        lib = "transformer_engine" if te_impl == "transformer_engine" and "transformer_engine" in err else LIBRARY[impl]
        return f"{lib} not importable ({err})"
    return None


def device_info() -> dict:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    else:
        name = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        name = f"CPU: {name} ({os.cpu_count()} cores)"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def megalm_flops(shape: dict) -> float:
    from megalm.flops import transformer_flops

    s = shape
    return transformer_flops(
        s["micro_batch"], s["seq"], s["layers"], s["hidden"], s["heads"], s["ffn"], s["vocab"],
        num_query_groups=s["groups"], swiglu=s["arch"] == "llama",
    )  # fmt: skip


def run_group(names, shape_name, args, log_dir, deadline) -> dict:
    shape = SHAPES[shape_name]
    res, workers = {}, []
    threads = max(1, (os.cpu_count() or 2) // len(names)) if args.threads == 0 else args.threads
    try:
        for name in names:
            impl, te_impl, comp = ROWS[name]
            row = dict(impl=impl, te_impl=te_impl, compile=comp, precision=args.precision,
                       train_iters=args.warmup + args.rounds * args.steps + 10)  # fmt: skip
            workers.append(Worker(f"{shape_name}-{name}", dict(row=row, shape=shape, threads=threads), log_dir))
        live = []
        for w in workers:
            try:
                info = w.call(cmd="build")
                w_res = res[w.name] = dict(info, times=[], cpu_times=[], losses=[])
                w_res["warmup"] = w.call(cmd="run", steps=args.warmup)["times"]
                live.append(w)
                print(f"  {w.name}: {info['params']:,} params, built in {info['setup_s']:.1f} s, warm-up "
                      + ", ".join(f"{t:.2f}" for t in w_res["warmup"]) + " s", flush=True)  # fmt: skip
            except RuntimeError as e:
                res[w.name] = {"error": str(e)}
                print(f"  {w.name}: FAILED {str(e).splitlines()[0][:300]}", flush=True)
        for rnd in range(args.rounds):
            if rnd and time.monotonic() > deadline:
                print(f"  budget spent: {rnd} of {args.rounds} rounds", flush=True)
                break
            shift = rnd % max(1, len(live))
            for w in live[shift:] + live[:shift]:
                try:
                    r = w.call(cmd="run", steps=args.steps)
                    res[w.name]["times"] += r["times"]
                    res[w.name]["cpu_times"] += r["cpu_times"]
                    res[w.name]["losses"] += r["losses"]
                except RuntimeError as e:
                    res[w.name]["error"] = str(e)
            live = [w for w in live if "error" not in res[w.name]]
        for w in live:
            res[w.name].update(w.call(cmd="stats"))
    finally:
        for w in workers:
            w.close()
    return res


def make_row(name, shape_name, r, peak, flops) -> dict:
    shape = SHAPES[shape_name]
    row = {"shape": shape_name, "row": name, "library": LIBRARY[ROWS[name][0]]}
    if "error" in r or not r.get("times"):
        return dict(row, error=r.get("error", "no timed steps"))
    med = statistics.median(r["times"])
    tokens = shape["micro_batch"] * shape["seq"]
    own = r.get("own_flops_per_step")
    return dict(
        row,
        params=r["params"],
        step_s=med,
        cpu_s_per_step=statistics.median(r["cpu_times"]),
        steps_timed=len(r["times"]),
        tokens_per_s=tokens / med,
        tflops=flops / med / 1e12,
        mfu=flops / med / peak,
        own_mfu=own / med / peak if own else None,
        peak_mem_gib=r.get("peak_bytes", 0) / 2**30,
        peak_kind=r.get("peak_kind"),
        first_loss=r["losses"][0] if r["losses"] else None,
        last_loss=r["losses"][-1] if r["losses"] else None,
        setup_s=r["setup_s"],
        warmup_s=r["warmup"],
        path=r.get("path"),
    )


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"| {row['shape']} | {row['row']} | FAILED: {row['error'].splitlines()[0][:200]} |", flush=True)
        return
    own = f"{row['own_mfu']:.1%}" if row.get("own_mfu") else "-"
    print(f"| {row['shape']} | {row['row']} | {row['tokens_per_s']:,.0f} | {row['mfu']:.1%} | {own} | "
          f"{row['peak_mem_gib']:.2f} | {row['step_s'] * 1e3:.1f} | {row['params']:,} |", flush=True)  # fmt: skip


def write_outputs(out_dir: str, result: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    labels = [f"{r['shape']} {r['row']}" for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"], i, f" {r['mfu']:.0%} MFU", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s")
    ax.set_title(f"{result['device']}, torch {result['torch']}, {result['precision']}, {result['date'][:10]}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "gpu_compare.png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--_worker":
        worker_main(sys.argv[2])
        return 0
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_compare.json, gpu_compare.png and the worker logs")
    p.add_argument("--shapes", default="llama1b,gpt3-1.3b" if cuda else "tiny", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--rows", default=",".join(ROWS), help="rows to run, in order (default: all)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary of the llama shapes (e.g. 128256)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="override the shapes' micro-batch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row (compiles happen here)")
    p.add_argument("--rounds", type=int, default=3, help="alternation rounds")
    p.add_argument("--steps", type=int, default=5 if cuda else 2, help="timed steps per row per round")
    p.add_argument("--live", type=int, default=3 if cuda else 0, help="workers alive at once (0: all rows)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per worker (0: cores / workers)")
    p.add_argument("--budget-s", type=float, default=330.0, help="seconds after which no group or round starts")
    args = p.parse_args(argv)
    for k in args.shapes.split(","):
        if k not in SHAPES:
            p.error(f"--shapes: unknown shape {k!r} (known: {', '.join(SHAPES)})")
        if args.vocab and SHAPES[k]["arch"] == "llama":
            SHAPES[k]["vocab"] = args.vocab
        if args.micro_batch_size:
            SHAPES[k]["micro_batch"] = args.micro_batch_size
    rows = args.rows.split(",")
    for r in rows:
        if r not in ROWS:
            p.error(f"--rows: unknown row {r!r} (known: {', '.join(ROWS)})")

    from megalm.flops import device_peak_flops

    start = time.monotonic()
    deadline = start + args.budget_s
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    peak, peak_source = device_peak_flops(torch.bfloat16 if args.precision == "bf16" else torch.float32)
    result = dict(device_info(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join([os.path.basename(sys.executable), *sys.argv]), precision=args.precision,
                  peak_flops=peak, peak_source=peak_source, shapes={k: SHAPES[k] for k in args.shapes.split(",")},
                  rows=[], skipped=[], budget_s=args.budget_s)  # fmt: skip
    print(f"# {result['device']}, torch {result['torch']}, {args.precision}, peak {peak / 1e12:.3g} TFLOP/s "
          f"({peak_source}), {result['date']}", flush=True)  # fmt: skip
    print("| shape | row | tokens/s | MFU (megalm) | MFU (own) | peak GiB | step ms | params |", flush=True)
    # Groups in priority order: the first group of every shape, then the second, ... (the budget cuts the last).
    plan = []
    for shape_name in args.shapes.split(","):
        todo = []
        for name in rows:
            why = skip_reason(name, SHAPES[shape_name])
            if why:
                print(f"  skip {shape_name} {name}: {why}", flush=True)
                result["skipped"].append({"shape": shape_name, "row": name, "reason": why})
            else:
                todo.append(name)
        live = args.live or len(todo) or 1
        plan += [(i // live, shape_name, todo[i : i + live]) for i in range(0, len(todo), live)]
    for _, shape_name, group in sorted(plan, key=lambda g: g[0]):
        if time.monotonic() > deadline:
            print(f"  budget {args.budget_s:.0f} s spent: not run {shape_name} {', '.join(group)}", flush=True)
            result["skipped"] += [{"shape": shape_name, "row": n, "reason": "budget"} for n in group]
            continue
        res = run_group(group, shape_name, args, log_dir, deadline)
        for name in group:
            row = make_row(name, shape_name, res[f"{shape_name}-{name}"], peak, megalm_flops(SHAPES[shape_name]))
            result["rows"].append(row)
            print_row(row)
        write_outputs(args.out, result)
    status = 0
    for shape_name in args.shapes.split(","):
        counts = {r["row"]: r["params"] for r in result["rows"] if r["shape"] == shape_name and "params" in r}
        if len(set(counts.values())) > 1:
            print(f"ERROR: parameter counts differ at {shape_name}: {counts}", flush=True)
            result.setdefault("errors", []).append(f"parameter counts differ at {shape_name}: {counts}")
            status = 1
    result["elapsed_s"] = time.monotonic() - start
    write_outputs(args.out, result)
    print(f"# wrote {os.path.join(args.out, 'gpu_compare.json')} in {result['elapsed_s']:.0f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

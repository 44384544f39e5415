"""From step times to the report of bench/train_throughput.py.

megalm's model-FLOPs formula and its measured matmul peak (the TFLOP/s and MFU columns), quantiles,
the Markdown results table, the notes under it, the per-row torch.profiler tables (``--profile``)
and the bar chart (``--plot``, needs matplotlib)."""

from __future__ import annotations

import math
import time
from typing import Dict, List

from reference_models import IMPL_NAMES, PRECISIONS, SHAPES, THREADS


def flops_per_step(shape: dict) -> float:
    """megalm's model-FLOPs formula for one step of ``micro_batch`` sequences."""
    from megalm.config import ModelConfig
    from megalm.flops import num_floating_point_operations

    m = ModelConfig(
        num_layers=shape["layers"],
        hidden_size=shape["hidden"],
        ffn_hidden_size=shape["ffn"],
        num_attention_heads=shape["heads"],
        seq_length=shape["seq"],
        swiglu=True,
        vocab_size=shape["vocab"],
        padded_vocab_size=shape["vocab"],
        position_embedding_type="rope",
        normalization="RMSNorm",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    )
    return num_floating_point_operations(m, shape["micro_batch"])


def measure_peaks(warmup_s: float = 1.0, repeats: int = 3, precisions=("fp32", "bf16")) -> Dict[str, dict]:
    """megalm's device peak (CPU: a measured 1024^3 matmul) per precision in ``precisions``, at
    THREADS threads (only those measured: a CPU without native bf16 takes seconds per bf16 matmul)."""
    import torch

    from megalm import flops
    from megalm.flops import device_peak_flops

    torch.set_num_threads(THREADS)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in precisions:
            continue
        # megalm measures once, after a single warm-up matmul; the first matmuls of a process run
        # well below the steady rate here, so warm up for ~1 s first and keep the best of several.
        a = torch.randn(1024, 1024).to(dtype)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warmup_s:
            torch.matmul(a, a)
        best, source = 0.0, ""
        for _ in range(repeats):
            flops.measure_matmul_flops.cache_clear()  # measured once per process otherwise
            peak, source = device_peak_flops(dtype, device=torch.device("cpu"))
            best = max(best, peak)
        out[name] = {"flops": best, "source": source, "measurements": repeats}
    return out


def update_peaks(peaks: dict, new: dict) -> None:
    """Keep the best peak seen (the machine is shared: a slow measurement means someone else ran)."""
    for k, v in new.items():
        old = peaks.setdefault(k, {"flops": 0.0, "source": v["source"], "measurements": 0})
        old["measurements"] += v["measurements"]
        if v["flops"] > old["flops"]:
            old["flops"] = v["flops"]


def quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def markdown_table(rows: List[dict]) -> str:
    head = (
        "| shape | implementation | precision | fusions | params | step ms (median) | ± IQR/2 | tokens/s | TFLOP/s "
        "| MFU | vs HF | vs plain | CPU s/step | peak RSS MB | RSS increase MB | first step s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = lambda v: f"{v:.2f}x" if v is not None else "-"  # noqa: E731
        first = f"{r['warmup_times_s'][0]:.2f}" if r["warmup_times_s"] else "-"
        lines.append(
            f"| {r['shape']} | {r['implementation']} | {r['precision']} | {r['fusions'] or '-'} | "
            f"{r['params'] / 1e6:.2f} M | {r['median_step_s'] * 1e3:.0f} | ±{100 * r['iqr_rel'] / 2:.0f}% | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.3f} | {100 * r['mfu']:.1f}% | {ratio(r['vs_hf'])} | "
            f"{ratio(r['vs_plain'])} | {r['median_cpu_s']:.2f} | {r['maxrss_mb']:,.0f} | "
            f"{r['rss_increase_mb']:,.0f} | {first} |"
        )
    return "\n".join(lines)


def notes(rows: List[dict]) -> List[str]:
    """Things that make a row mean less than it seems (flags left out, compiles during timing)."""
    out = []
    for r in rows:
        if r.get("dropped_flags"):
            out.append(f"{r['shape']} {r['name']}: this megalm does not know {' '.join(r['dropped_flags'])} (left out)")
        a, b = r.get("compile_after_warmup"), r.get("compile_at_end")
        if a and b and b["graphs"] > a["graphs"]:
            out.append(
                f"{r['shape']} {r['name']}: {b['graphs'] - a['graphs']} torch.compile graph(s) compiled during "
                f"the timed steps ({b['seconds'] - a['seconds']:.1f} s): raise --warmup"
            )
    noisy = [f"{r['shape']} {r['name']} (±{100 * r['iqr_rel'] / 2:.0f}%)" for r in rows if r["iqr_rel"] > 0.3]
    if noisy:
        out.append(
            "noisy rows (steps slowed by other jobs in some rounds; see the per-round lines on stderr, "
            "rerun on a quieter machine): " + ", ".join(noisy)
        )
    unlisted = sorted({f for r in rows for f in (r.get("unlisted_fusion_flags") or [])})
    if unlisted:
        out.append(f"megalm fusion flags in neither MEGALM_FUSION_FLAGS list: {' '.join(unlisted)}")
    compiled = [
        f"{r['name']} {r['compile_at_end']['graphs']} graphs / {r['compile_at_end']['seconds']:.1f} s"
        for r in rows
        if r.get("compile_at_end") and r["compile_at_end"]["graphs"]
    ]
    if compiled:
        out.append("megalm torch.compile, graphs / seconds compiling: " + ", ".join(compiled))
    return out


def profile_tables(rows: List[dict]) -> str:
    out = []
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        out.append(
            f"\n### profile: {r['shape']} {r['name']} (per step, median of {p['steps']}: "
            f"{p['wall_s'] * 1e3:.0f} ms wall under the profiler, self CPU total "
            f"{p['self_cpu_total_us'] / 1e3:.0f} ms)\n"
        )
        out.append("| op | self CPU ms/step | % | calls/step |")
        out.append("|---|---|---|---|")
        for e in p["top"]:
            op = e["op"]
            if op.startswith("## Call CompiledFxGraph"):  # inductor graphs are named by a hash
                op = f"torch.compile graph {op.split()[3][:10]}"
            out.append(
                f"| {op} | {e['self_cpu_us'] / 1e3:.1f} | "
                f"{100 * e['self_cpu_us'] / max(p['self_cpu_total_us'], 1):.1f} | {e['calls']:g} |"
            )
    return "\n".join(out)


def plot(rows: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sub = [r for r in rows if r["shape"] == shape]
        precisions = [p for p in PRECISIONS if any(r["precision"] == p for r in sub)]
        series = list(dict.fromkeys((r["impl"], r["fusions"]) for r in sub))
        width = 0.8 / max(len(series), 1)
        for i, (impl, fusions) in enumerate(series):
            label = IMPL_NAMES[impl] + (f", fusions {fusions}" if fusions else "")
            values = [
                next(
                    (
                        r["tokens_per_s"]
                        for r in sub
                        if r["impl"] == impl and r["fusions"] == fusions and r["precision"] == p
                    ),
                    0.0,
                )
                for p in precisions
            ]
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(precisions))]
            bars = ax.bar(xs, values, width, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_ylim(top=1.35 * max((r["tokens_per_s"] for r in sub), default=1.0))  # room for the legend
        ax.set_xticks(range(len(precisions)), precisions)
        ax.set_ylabel("tokens/s (higher is better)")
        s = SHAPES[shape]
        ax.set_title(f"{shape}: h {s['hidden']}, L {s['layers']}, seq {s['seq']}, V {s['vocab']}, b {s['micro_batch']}")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"training-step throughput, {THREADS} threads (fwd + bwd + AdamW)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

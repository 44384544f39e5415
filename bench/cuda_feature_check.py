"""Short CUDA check of the features built and tested on CPU only: one process, one GPU, NCCL.

Runs ``pretrain_gpt.main`` in this process for a list of small configurations (mock data, a GPT of
4 layers x 256, bf16 unless named) and prints one line per run: exit code, first and last loss, peak
GPU memory.  Pairs that must train to the same numbers (optimizer offload vs none, ZeRO-2/3 at one
data-parallel rank vs plain DP) are compared and reported as ``same`` or the largest relative gap.
Exits 1 if any run fails or a pair differs.  Needs about a minute on an H100/H200; writes nothing
outside ``--out`` (default: a temporary directory).

    python bench/cuda_feature_check.py [--iters 12] [--only name,name]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--mock-data", "--vocab-size", "4096", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "1000",
    "--eval-iters", "0", "--seed", "1234", "--num-workers", "0",
]  # fmt: skip
BF16 = ["--bf16"]

RUNS = {
    "adam_bf16": BF16,
    "adam_bf16_again": BF16,  # how far two identical runs differ on this device
    "adam_bf16_offload": BF16 + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"],
    "adam_bf16_offload_half_overlap": BF16
    + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5", "--overlap-cpu-optimizer-d2h-h2d"],
    "adam_bf16_activation_offload": BF16 + ["--cpu-offloading", "--cpu-offloading-num-layers", "2"],
    "zero1_bf16": BF16 + ["--data-parallel-sharding-strategy", "optim"],
    "zero2_bf16": BF16 + ["--data-parallel-sharding-strategy", "optim_grads"],
    "zero3_bf16": BF16 + ["--data-parallel-sharding-strategy", "optim_grads_params"],
    "zero3_bf16_prefetch": BF16 + ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-param-gather"],
    "lamb_bf16": BF16 + ["--optimizer", "lamb"],
    "muon_bf16": BF16 + ["--optimizer", "muon"],
    "muon_bf16_medium": BF16 + ["--optimizer", "muon", "--muon-fp32-matmul-prec", "medium"],  # Megatron's bf16 NS
    "lamb_bf16_offload_half_overlap": BF16
    + ["--optimizer", "lamb", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
       "--overlap-cpu-optimizer-d2h-h2d"],
    "muon_bf16_offload": BF16
    + ["--optimizer", "muon", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"],
    "lion_bf16": BF16 + ["--optimizer", "lion", "--lr", "1e-4", "--min-lr", "1e-5"],
    "recipe_bf16": BF16
    + ["--qk-layernorm", "--apply-layernorm-1p", "--grad-reduce-in-bf16", "--normalization", "RMSNorm",
       "--swiglu", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"],
    "moe_expert_bias_bf16": BF16
    + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "0"],
    "keyed_attention_dropout_bf16": BF16 + ["--attention-dropout", "0.1", "--position-keyed-attention-dropout"],
    "reset_attention_mask_bf16": BF16 + ["--reset-attention-mask", "--reset-position-ids"],
    "fp16": ["--fp16", "--initial-loss-scale", "4096"],  # from 2^32 the first ~20 steps are skipped
}  # fmt: skip
# (run, reference, allowed relative gap): None allows the gap between the two identical plain runs
SAME = [
    ("adam_bf16_offload", "adam_bf16", 1e-2),  # the CPU step runs the fp32 math on other hardware
    ("adam_bf16_offload_half_overlap", "adam_bf16_offload", 1e-2),
    ("adam_bf16_activation_offload", "adam_bf16", None),  # the same kernels on the same bytes
    ("zero1_bf16", "adam_bf16", None),
    ("zero2_bf16", "adam_bf16", None),
    ("zero3_bf16", "adam_bf16", None),
    ("zero3_bf16_prefetch", "zero3_bf16", None),
    ("lamb_bf16_offload_half_overlap", "lamb_bf16", 1e-2),  # host norms and step, device rest
    ("muon_bf16_offload", "muon_bf16", 1e-2),  # Newton-Schulz on the device, the update applied on the host
    ("muon_bf16_medium", "muon_bf16", 1e-2),  # bf16 iterations: within bf16 rounding of fp32 ones
]


def max_rel_gap(a: list, b: list) -> float:
    if not a or len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def losses(path: Path) -> list:
    if not path.exists():
        return []
    rows = map(json.loads, path.read_text().splitlines())
    return [r["lm_loss"] for r in rows if r.get("lm_loss") is not None]  # None: a skipped fp16 step


def run_one(name: str, flags: list, iters: int, out: Path) -> dict:
    import torch

    import pretrain_gpt
    from megalm import parallel_state

    metrics = out / f"{name}.jsonl"
    argv = MODEL + ["--train-iters", str(iters), "--metrics-file", str(metrics)] + flags
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    start = time.time()
    try:
        pretrain_gpt.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else str(e.code)
    except Exception as e:  # noqa: BLE001 - report and go on with the next run
        code = f"{type(e).__name__}: {e}"
    parallel_state.destroy_model_parallel()
    return {
        "code": code,
        "losses": losses(metrics),
        "seconds": time.time() - start,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_initialized() else 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--out", default=None)
    p.add_argument("--cpu", action="store_true", help="run the list on the CPU with gloo (to check the script)")
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    if not args.cpu and not torch.cuda.is_available():
        print("cuda_feature_check: no CUDA device here; nothing to check (--cpu runs the list on the CPU)")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", WANDB_MODE="disabled")
    if args.cpu:
        os.environ["MEGALM_FORCE_CPU"] = "1"
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="cuda_feature_check_"))
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    results, bad = {}, 0
    for name in names:
        r = results[name] = run_one(name, RUNS[name], args.iters, out)
        ls = r["losses"]
        first_last = f"{ls[0]:.4f} -> {ls[-1]:.4f}" if ls else "no losses"
        print(
            f"== {name}: rc={r['code']} {first_last} ({len(ls)} it, {r['seconds']:.1f} s, peak {r['peak_gb']:.2f} GB)"
        )
        bad += r["code"] != 0 or len(ls) != args.iters
    noise = None
    if "adam_bf16" in results and "adam_bf16_again" in results:
        noise = max_rel_gap(results["adam_bf16_again"]["losses"], results["adam_bf16"]["losses"])
        print(f"== two identical plain runs: max rel gap {noise:.2e}")
    for run, ref, rel in SAME:
        rel = noise if rel is None else rel
        if rel is not None and run in results and ref in results:
            gap = max_rel_gap(results[run]["losses"], results[ref]["losses"])
            ok = gap <= rel
            bad += not ok
            print(f"== same {run} vs {ref}: {'same' if gap == 0 else f'max rel gap {gap:.2e}'} (allowed {rel})")
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    print(f"cuda_feature_check: {'OK' if not bad else f'{bad} problem(s)'}; metrics in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

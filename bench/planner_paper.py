#!/usr/bin/env python
"""The planner's choices "on paper" for GPT-3 175B, Llama-3 8B / 70B and Mixtral 8x7B on 8-node and 64-node
H100 clusters (the ``h100`` preset: 8 GPUs per node, NVLink 450 GB/s per direction, 8 x 400 Gb/s IB per node),
beside the layouts NVIDIA published, and the planner's prediction for the published layout itself.

Published layouts (bf16, H100):

* GPT-3 175B: Megatron-LM ``examples/gpt3/train_gpt3_175b_distributed.sh`` (megalm's ``gpt3_175b`` preset):
  TP 8, PP 16, micro batch 1, global batch 1536, sequence 2048;
* Llama-3 8B: Megatron-Bridge ``scripts/performance/configs/llama`` (``LLAMA3_8B_PRETRAIN_CONFIG_H100_BF16``):
  8 GPUs, TP 1, PP 1, CP 2, micro batch 1, global batch 128, sequence 8192;
* Llama-3 70B: the same file (``LLAMA3_70B_PRETRAIN_CONFIG_H100_BF16_V1``): 64 GPUs, TP 4, PP 4, VPP 5, CP 2,
  micro batch 1, global batch 256, sequence 8192;
* Mixtral 8x7B: Megatron-LM ``examples/mixtral`` (megalm's ``mixtral_8x7b`` preset): TP 1, PP 4, EP 8, full
  recompute, micro batch 1, global batch 256, sequence 4096.

The search is narrowed to what such runs use (sequence parallelism with TP, the distributed optimizer or
ZeRO-3, CP <= 2, micro batch <= 4) to keep it to minutes; ``--json`` keeps every row.

    python3 bench/planner_paper.py [--nodes 8,64] [--json bench/results/planner_paper.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, ROOT)

from megalm.planner.search import Layout, SearchOptions, apply_layout, largest_rank_bytes, search  # noqa: E402

LLAMA3_70B = ["--preset", "llama2_70b", "--seq-length", "8192", "--max-position-embeddings", "8192"]
LLAMA3_70B += ["--vocab-size", "128255", "--rotary-base", "500000", "--global-batch-size", "256"]
MODELS = [
    (
        "GPT-3 175B",
        ["--preset", "gpt3_175b"],
        Layout(tp=8, pp=16, sp=True, strategy="optim", micro_batch=1),
        "TP8 PP16 (Megatron-LM examples/gpt3)",
    ),
    (
        "Llama-3 8B",
        ["--preset", "llama3_8b", "--global-batch-size", "128"],
        Layout(cp=2, strategy="optim", micro_batch=1),
        "TP1 PP1 CP2 (Megatron-Bridge H100 bf16, 8 GPUs)",
    ),
    (
        "Llama-3 70B",
        LLAMA3_70B,
        Layout(tp=4, pp=4, vpp=5, cp=2, sp=True, strategy="optim", micro_batch=1),
        "TP4 PP4 VPP5 CP2 (Megatron-Bridge H100 bf16, 64 GPUs)",
    ),
    (
        "Mixtral 8x7B",
        ["--preset", "mixtral_8x7b"],
        Layout(pp=4, ep=8, strategy="optim", recompute="full", micro_batch=1),
        "TP1 PP4 EP8, full recompute (Megatron-LM examples/mixtral)",
    ),
]
OPTIONS = SearchOptions(max_cp=2, max_micro_batch=4, sequence_parallel="on", strategies=("optim", "optim_grads_params"))


def main(argv=None) -> int:
    from megalm.planner.cli import cluster_of, parse
    from megalm.planner.cost import step_cost

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="8,64")
    p.add_argument("--only", help="comma-separated model names (e.g. 'Llama-3 8B')")
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        for name, flags, published, source in MODELS:
            if args.only and name not in args.only.split(","):
                continue
            t0 = time.time()
            cfg, options, _ = parse(flags + ["--cluster", "h100", "--nodes", str(nodes)])
            cluster = cluster_of(options)
            result = search(cfg, cluster, OPTIONS)
            row = {"model": name, "nodes": nodes, "published": source, "considered": result.considered}
            row["refused"], row["too_big"], row["ranked"] = (
                sum(result.refused.values()),
                result.too_big,
                len(result.candidates),
            )
            if result.candidates:
                best = result.candidates[0]
                row |= {
                    "choice": best.layout.short() + f" DP{best.dp}",
                    "choice_step_s": best.cost.step_s,
                    "choice_gb": best.memory_bytes / 1e9,
                    "choice_dominant": best.cost.dominant,
                    "choice_terms": best.cost.terms,
                }
            try:
                pub = apply_layout(cfg, published, cluster.world_size)
                cost = step_cost(pub, cluster)
                row |= {
                    "published_step_s": cost.step_s,
                    "published_gb": largest_rank_bytes(pub, cluster) / 1e9,
                    "published_dominant": cost.dominant,
                    "published_terms": cost.terms,
                }
            except Exception as e:  # noqa: BLE001 - e.g. the published layout does not fit this world
                row["published_error"] = str(e)
            row["search_s"] = time.time() - t0
            print(json.dumps(row, default=str), file=sys.stderr, flush=True)
            rows.append(row)
    print(
        "| model | nodes x 8 H100 | planner's choice | predicted s/step | GB/rank | dominant | published layout | "
        "its predicted s/step | GB/rank |"
    )
    print("|" + "---|" * 9)
    for r in rows:
        pub = (
            f"{r['published_step_s']:.2f} | {r['published_gb']:.0f}"
            if "published_step_s" in r
            else f"refused: {r.get('published_error', '')[:80]} | -"
        )
        choice = (
            f"{r['choice']} | {r['choice_step_s']:.2f} | {r['choice_gb']:.0f} | {r['choice_dominant']}"
            if "choice" in r
            else "none fits | - | - | -"
        )
        print(f"| {r['model']} | {r['nodes']} | {choice} | {r['published']} | {pub} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Build peak per ``--data-parallel-sharding-strategy`` with and without ``--init-model-with-meta-device``.

On ``--ranks`` spawned gloo ranks (pure data parallel), builds a Llama-style fp32 model (RMSNorm, SwiGLU,
RoPE, untied output layer; ``--layers``, ``--hidden``, FFN 4 x hidden, ``--vocab``) and wraps it in DDP
(``--overlap-grad-reduce``, ``--ddp-bucket-size`` 12 x hidden^2: about a layer), once per strategy and
flag, and reports the CPU allocator's own count (:class:`megalm.training.memory.TrackedAllocations`) of
live tensor bytes: the peak during the build and what is held after it.  The formula beside ZeRO-3 with
the flag: ``P/K`` (weight shards) ``+ B`` (one bucket) ``+ M`` (one parameter's fp32 initial value) while
the buckets are filled, then ``2 P/K`` (weight and gradient shards).  Bytes, not times: the load of the
machine does not change them.

    python bench/meta_init_peak.py [--ranks 2] [--layers 4 --hidden 256 --vocab 32000] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.abspath(os.path.join(HERE, os.path.pardir))
if _root not in sys.path:
    sys.path.insert(0, _root)

from megalm.launch.spawn import run_distributed  # noqa: E402

MiB = 1024 * 1024
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _provider(cfg, pre_process=True, post_process=True, layer_numbers=None, *, process_groups, rng_tracker):
    from megalm.models import GPTModel

    return GPTModel(
        cfg, pre_process, post_process, layer_numbers, process_groups=process_groups, rng_tracker=rng_tracker
    )


def _config(a, strategy: str, meta: bool):
    from megalm.config import MegalmConfig, set_vocab_size, validate_config

    cfg = MegalmConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = a.layers, a.hidden, 4 * a.hidden, 8
    m.seq_length, m.max_position_embeddings, m.vocab_size = 32, 32, a.vocab
    m.position_embedding_type, m.normalization, m.swiglu = "rope", "RMSNorm", True
    m.add_bias_linear, m.untie_embeddings_and_output_weights = False, True
    validate_config(cfg)
    set_vocab_size(cfg, a.vocab)
    cfg = copy.deepcopy(cfg)  # validated configs are frozen
    p = cfg.parallel
    p.data_parallel_sharding_strategy, p.overlap_grad_reduce, p.ddp_bucket_size = strategy, True, 12 * a.hidden**2
    p.init_model_with_meta_device = meta
    return cfg


def worker(a) -> dict:
    from megalm import parallel_state
    from megalm.tensor_parallel.random import RNGStatesTracker
    from megalm.training.build import build_model_chunks, wrap_data_parallel
    from megalm.training.memory import TrackedAllocations

    parallel_state.initialize_model_parallel(1, 1)
    groups = parallel_state.get_process_groups()
    rows = {}
    for strategy in STRATEGIES:
        for meta in (False, True):
            cfg = _config(a, strategy, meta)
            gc.collect()
            with TrackedAllocations() as tracked:
                (ddp,) = wrap_data_parallel(cfg, build_model_chunks(cfg, _provider, groups, RNGStatesTracker()), groups)
            rows[f"{strategy} meta={int(meta)}"] = {
                "params": sum(p.numel() for p in ddp.parameters()),
                "largest_param": max(p.numel() for p in ddp.parameters()),
                "largest_bucket": max(b.numel for buf in ddp.all_buffers for b in buf.buckets),
                "build_peak": tracked.peak,
                "after_build": tracked.end,
            }
            del ddp
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out")
    a = ap.parse_args()
    ranks = run_distributed(worker, a.ranks, args=(a,), timeout=1800)
    rows = {k: {f: max(r[k][f] for r in ranks) for f in ranks[0][k]} for k in ranks[0]}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    first = next(iter(rows.values()))
    n, k = first["params"], a.ranks
    print(f"\n{n / 1e6:.1f}M parameters, fp32, DP {k}; {cpu}\n")
    print("| strategy | build peak MiB | with the flag MiB | held after the build MiB |")
    print("|---|---|---|---|")
    for s in STRATEGIES:
        plain, meta = rows[f"{s} meta=0"], rows[f"{s} meta=1"]
        print(
            f"| {s} | {plain['build_peak'] / MiB:.1f} | {meta['build_peak'] / MiB:.1f} | "
            f"{meta['after_build'] / MiB:.1f} |"
        )
    z3 = rows["optim_grads_params meta=1"]
    bound = 4 * (n / k + z3["largest_bucket"] + z3["largest_param"])
    print(f"\nZeRO-3 with the flag: P/K + B + M = {bound / MiB:.1f} MiB, 2P/K = {8 * n / k / MiB:.1f} MiB")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"ranks": k, "cpu": cpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

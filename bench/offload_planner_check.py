#!/usr/bin/env python
"""The planner's optimizer-offload bytes against the built optimizer's, on one process.

For each model (a bf16 Llama-style GPT, untied) and each of ``--optimizer-cpu-offload`` and
``--optimizer-offload-device nvme`` (swap files under ``--offload-path``, removed after), prints the planner's
(:func:`megalm.estimate.planner.plan`) and the built optimizer's (``memory_breakdown()``, the swap files'
payload) bytes: the optimizer bytes left on the device, the host bytes (CPU offload: copies, gradient buffers,
moments; NVMe: the two staging slots) and the swap-file bytes (read and written once per step).  Bytes, not
times.

    python bench/offload_planner_check.py [--offload-path /var/tmp] [--dp 1 2]

``--dp 2``: also on two spawned ranks with ZeRO-2 (the distributed optimizer's ranges: pieces of tensors),
the largest rank's bytes.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
_root = os.path.abspath(os.path.join(HERE, os.path.pardir))
if _root not in sys.path:
    sys.path.insert(0, _root)

MiB = 2**20
MODELS = {"tiny": (3, 64, 96, 200), "62.9M": (8, 768, 2048, 4096)}  # layers, hidden, ffn, vocabulary


def _config(layers, hidden, ffn, vocab, device, path):
    from megalm.config import MegalmConfig, set_vocab_size, validate_config

    cfg = MegalmConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = layers, hidden, 8, ffn
    m.seq_length, m.vocab_size = 128, vocab
    m.position_embedding_type, m.normalization, m.swiglu, m.add_bias_linear = "rope", "RMSNorm", True, False
    m.untie_embeddings_and_output_weights = True
    cfg.training.bf16 = True
    validate_config(cfg, world_size=1)
    set_vocab_size(cfg, vocab)
    cfg = copy.deepcopy(cfg)  # validated configs are frozen
    if device == "cpu":
        cfg.training.optimizer_cpu_offload = True
    else:
        cfg.training.optimizer_offload_device, cfg.training.offload_path = "nvme", path
    return cfg


def _measure(shape, device: str, path: str, dp: int):
    """On each of ``dp`` ranks (one process when 1; ZeRO-2 when more): the planner's stage 0 and the built
    optimizer's ``(device optimizer, host, swap-file)`` bytes."""
    import torch

    from megalm import parallel_state
    from megalm.distributed.data_parallel import DistributedDataParallel
    from megalm.estimate.planner import PlannerOptions, plan
    from megalm.models import GPTModel
    from megalm.optimizer import build_optimizer

    if dp > 1:
        parallel_state.initialize_model_parallel()
    groups = parallel_state.get_process_groups() if dp > 1 else parallel_state.ProcessGroups.single()
    cfg = _config(*shape, device, path)
    if dp > 1:
        cfg.parallel.world_size = cfg.parallel.data_parallel_size = dp
        cfg.parallel.data_parallel_sharding_strategy = "optim_grads"
    st = plan(cfg, PlannerOptions(world_size=dp))["stages"][0]
    model = GPTModel(cfg, process_groups=groups).to(torch.bfloat16)
    ddp = DistributedDataParallel(model, cfg.parallel, process_groups=groups)
    optimizer = build_optimizer(cfg, [ddp], report_memory=False, process_groups=groups)
    built = optimizer.memory_breakdown()
    on_device = built["main_params"] + built["main_grads"] + built["optimizer_state"]
    disk = optimizer.offload.disk_bytes if device == "nvme" else 0
    optimizer.close()
    key = "optimizer_distributed" if dp > 1 else "optimizer"
    return (st[key], st["offload_host"], st["offload_disk"]), (on_device, built["host"], disk)


def main() -> None:
    from megalm.launch.spawn import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--offload-path", default=tempfile.gettempdir())
    ap.add_argument("--dp", type=int, nargs="+", default=[1], help="data-parallel sizes (ZeRO-2 above 1)")
    a = ap.parse_args()
    print("| model | layout | offload | device optimizer MiB (planner / built) | host MiB | swap files MiB |")
    print("|---|---|---|---|---|---|")
    for name, shape in MODELS.items():
        for dp in a.dp:
            for device in ("cpu", "nvme"):
                with tempfile.TemporaryDirectory(dir=a.offload_path) as d:
                    if dp == 1:
                        planned, built = _measure(shape, device, d, 1)
                    else:  # the largest rank's bytes
                        runs = run_distributed(_measure, dp, args=(shape, device, d, dp), timeout=900)
                        planned, built = max(runs, key=lambda r: r[1][1])
                layout = "1 rank" if dp == 1 else f"DP {dp}, ZeRO-2"
                cells = " | ".join(f"{p / MiB:.2f} / {b / MiB:.2f}" for p, b in zip(planned, built))
                print(f"| {name} | {layout} | {device} | {cells} |", flush=True)


if __name__ == "__main__":
    main()

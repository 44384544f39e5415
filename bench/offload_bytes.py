#!/usr/bin/env python
"""Bytes the offloads move per step, measured on the copies against the formulas.

Activation offloading (``--cpu-offloading --cpu-offloading-num-layers N``): one training microbatch
(forward + backward, micro batch 2) of a GPT (hidden 256, 4 layers, 8 heads, sequence 256, LayerNorm,
GELU; fp32 and bf16) and of a Llama-style model (RMSNorm, SwiGLU, RoPE, GQA 8/2; bf16), for N = 1..3:
bytes copied device-to-host (= host-to-device) per microbatch, counted by
:class:`megalm.host_transfer.HostTransfer`, against ``N x`` the planner's saved bytes per layer
(:func:`megalm.estimate.activations.layer_bytes`, CPU kernels).

Optimizer offload (``--optimizer-cpu-offload``, fractions 0.5 and 1, with and without
``--overlap-cpu-optimizer-d2h-h2d``): bytes per optimizer step against ``4 B`` per offloaded element each way.

Bytes only: on a CPU-only machine the "device" is the CPU, so a step-time ratio would time CPU-to-CPU
copies and says nothing about a GPU's PCIe link; no timing is reported.  Writes
bench/results/offload_bytes.json and bench/results/offload_bytes.svg.

    python bench/offload_bytes.py
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, os.path.pardir)))
sys.path.insert(0, HERE)
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # eager fusions: the same saved tensors, no compile time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from svg_plot import write_line_chart  # noqa: E402

from megalm.config import MegalmConfig, set_vocab_size, validate_config  # noqa: E402
from megalm.estimate.activations import Shape, layer_bytes  # noqa: E402
from megalm.models import GPTModel  # noqa: E402
from megalm.optimizer import build_optimizer  # noqa: E402

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    group_query_attention=True,
    num_query_groups=2,
)
MODELS = {"gpt-fp32": ({}, False), "gpt-bf16": ({}, True), "llama-bf16": (LLAMA, True)}
SEQ, MICRO = 256, 2


def make_cfg(model_kw: dict, bf16: bool, offload_layers: int = 0) -> MegalmConfig:
    cfg = MegalmConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 4, 256, 8, 1024
    m.seq_length, m.vocab_size, m.make_vocab_size_divisible_by = SEQ, 8192, 128
    m.hidden_dropout = m.attention_dropout = 0.0
    for k, v in model_kw.items():
        setattr(m, k, v)
    m.cpu_offloading, m.cpu_offloading_num_layers = offload_layers > 0, offload_layers
    cfg.training.bf16, cfg.training.micro_batch_size = bf16, MICRO
    validate_config(cfg, world_size=1)
    set_vocab_size(cfg, m.vocab_size)
    return cfg


def activation_bytes(name: str, n: int) -> dict:
    model_kw, bf16 = MODELS[name]
    cfg = make_cfg(model_kw, bf16, n)
    model = GPTModel(cfg).to(torch.bfloat16 if bf16 else torch.float32).train()
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 8192, (MICRO, SEQ), generator=g) for _ in range(2))
    model(tokens, None, labels).sum().backward()
    transfer = model.decoder.activation_offload.transfer
    sh = Shape(SEQ, MICRO, 1, False, 2 if bf16 else 4, device="cpu")
    formula = n * sum(layer_bytes(cfg.model, sh).values())
    return {"model": name, "layers": n, "d2h": transfer.bytes_d2h, "h2d": transfer.bytes_h2d, "formula": formula}


def optimizer_bytes(fraction: float, overlap: bool) -> dict:
    cfg = make_cfg({}, True)
    cfg.training.optimizer_cpu_offload, cfg.training.optimizer_offload_fraction = True, fraction
    cfg.training.overlap_cpu_optimizer_d2h_h2d = overlap
    model = GPTModel(cfg).to(torch.bfloat16)
    optimizer = build_optimizer(cfg, [model], report_memory=False)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 8192, (MICRO, SEQ), generator=g) for _ in range(2))
    F.relu(model(tokens, None, labels)).sum().backward()
    assert optimizer.step()[0]
    off = optimizer.offload
    return {
        "fraction": fraction,
        "overlap": overlap,
        "offloaded_elements": off.numel,
        "d2h": off.transfer.bytes_d2h,
        "h2d": off.transfer.bytes_h2d,
        "formula": 4 * off.numel,
    }


def main() -> None:
    acts = [activation_bytes(name, n) for name in MODELS for n in (1, 2, 3)]
    opts = [optimizer_bytes(f, o) for f in (0.5, 1.0) for o in (False, True)]
    print("| model | N layers | D2H = H2D per microbatch (MiB) | formula (MiB) | measured / formula |")
    print("|---|---|---|---|---|")
    for r in acts:
        assert r["d2h"] == r["h2d"]
        print(
            f"| {r['model']} | {r['layers']} | {r['d2h'] / 2**20:.2f} | {r['formula'] / 2**20:.2f} "
            f"| {r['d2h'] / r['formula']:.3f} |"
        )
    print()
    print("| offload fraction | overlap | offloaded elements | D2H / H2D per step (MiB) | 4 B x elements (MiB) |")
    print("|---|---|---|---|---|")
    for r in opts:
        print(
            f"| {r['fraction']} | {'yes' if r['overlap'] else 'no'} | {r['offloaded_elements']} "
            f"| {r['d2h'] / 2**20:.2f} / {r['h2d'] / 2**20:.2f} | {r['formula'] / 2**20:.2f} |"
        )
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "offload_bytes.json"), "w") as f:
        json.dump({"activations": acts, "optimizer": opts}, f, indent=1)
    series = {}
    for name in MODELS:
        rows = [r for r in acts if r["model"] == name]
        series[f"{name} measured"] = [(r["layers"], r["d2h"] / 2**20) for r in rows]
        series[f"{name} formula"] = [(r["layers"], r["formula"] / 2**20) for r in rows]
    write_line_chart(
        os.path.join(out, "offload_bytes.svg"),
        series,
        title="Activation offloading: bytes to the host per microbatch",
        xlabel="--cpu-offloading-num-layers",
        ylabel="MiB (D2H = H2D)",
    )


if __name__ == "__main__":
    main()

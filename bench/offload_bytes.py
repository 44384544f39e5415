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

from megalm.config import MegalmConfig, parse_config  # noqa: E402
from megalm.estimate.activations import Shape, layer_bytes  # noqa: E402
from megalm.models import GPTModel  # noqa: E402
from megalm.optimizer import build_optimizer  # noqa: E402
from megalm.parallel_state import get_process_groups  # noqa: E402

SEQ, MICRO = 256, 2
MODEL = f"""--num-layers 4 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 1024 --seq-length {SEQ}
    --vocab-size 8192 --make-vocab-size-divisible-by 128 --hidden-dropout 0 --attention-dropout 0
    --micro-batch-size {MICRO}""".split()
LLAMA = "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear".split()
LLAMA += "--group-query-attention --num-query-groups 2".split()
MODELS = {"gpt-fp32": ([], False), "gpt-bf16": ([], True), "llama-bf16": (LLAMA, True)}


def make_cfg(model_flags: list, bf16: bool, offload_layers: int = 0, extra: tuple = ()) -> MegalmConfig:
    """The validated configuration of these flags (one process), as the trainer parses them."""
    flags = MODEL + model_flags + (["--bf16"] if bf16 else []) + list(extra)
    if offload_layers:
        flags += ["--cpu-offloading", "--cpu-offloading-num-layers", str(offload_layers)]
    return parse_config(flags, world_size=1)


def activation_bytes(name: str, n: int) -> dict:
    model_flags, bf16 = MODELS[name]
    cfg = make_cfg(model_flags, bf16, n)
    model = GPTModel(cfg, process_groups=get_process_groups()).to(torch.bfloat16 if bf16 else torch.float32).train()
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 8192, (MICRO, SEQ), generator=g) for _ in range(2))
    model(tokens, None, labels).sum().backward()
    transfer = model.decoder.activation_offload.transfer
    sh = Shape(SEQ, MICRO, 1, False, 2 if bf16 else 4, device="cpu")
    formula = n * sum(layer_bytes(cfg.model, sh).values())
    return {"model": name, "layers": n, "d2h": transfer.bytes_d2h, "h2d": transfer.bytes_h2d, "formula": formula}


def optimizer_bytes(fraction: float, overlap: bool) -> dict:
    extra = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", str(fraction)]
    cfg = make_cfg([], True, extra=extra + (["--overlap-cpu-optimizer-d2h-h2d"] if overlap else []))
    model = GPTModel(cfg, process_groups=get_process_groups()).to(torch.bfloat16)
    optimizer = build_optimizer(cfg, [model], report_memory=False, process_groups=get_process_groups())
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

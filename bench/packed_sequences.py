#!/usr/bin/env python
"""Packed documents (``--qkv-format thd``) against the dense document mask (``--reset-attention-mask``).

One attention block (hidden 256, 8 heads of 32, GQA 8/2, RoPE; fp32, one process) on a micro-batch of 2 rows
of ``s`` tokens whose documents end at end-of-document tokens drawn with probability ``1/128`` per token (a
mean document of ~128 tokens), forward + backward, for the SDPA (``--attention-backend fused``) and blocked
cores: the time of the packed path over the dense one (median of interleaved repetitions, the same run), the
bytes the block saves for backward (distinct storages, through ``saved_tensors_hooks``, the mask included) and
the bytes of the mask against those of the packed parameters.

    python bench/packed_sequences.py [--seq 512 1024 2048] [--reps 5]

Writes bench/results/packed_sequences.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, os.path.pardir)))
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megalm.config import parse_config  # noqa: E402
from megalm.data.gpt_dataset import document_ids  # noqa: E402
from megalm.models import GPTModel  # noqa: E402
from megalm.parallel_state import get_process_groups  # noqa: E402
from megalm.transformer.attention_mask import document_causal_mask  # noqa: E402
from megalm.transformer.packed_seq import packed_seq_params_from_documents, positions_in_segments  # noqa: E402

B, EOD = 2, 0


def block(seq: int, backend: str):
    flags = f"""--num-layers 1 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2
        --seq-length {seq} --vocab-size 1024 --position-embedding-type rope --normalization RMSNorm --swiglu
        --hidden-dropout 0 --attention-dropout 0 --micro-batch-size {B} --attention-backend {backend}
        --reset-attention-mask --qkv-format thd""".split()
    model = GPTModel(parse_config(flags, world_size=1), process_groups=get_process_groups())
    return model, model.decoder.layers["0"].self_attention


def saved_bytes(fn) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


def measure(seq: int, backend: str, reps: int) -> dict:
    torch.manual_seed(0)
    model, attention = block(seq, backend)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 1024, (B, seq), generator=g)
    tokens[torch.rand(B, seq, generator=g) < 1 / 128] = EOD
    ids = torch.stack([document_ids(t, EOD) for t in tokens])
    params = packed_seq_params_from_documents(ids)
    cos, sin = model.rotary.tables(positions_in_segments(params), seq, "cpu")
    hidden = torch.randn(seq, B, 256, requires_grad=True)
    mask = document_causal_mask(ids)

    def run(documents):
        return attention(hidden, cos, sin, attention_mask=documents)[0]

    def step(documents):
        start = time.perf_counter()
        run(documents).sum().backward()
        return time.perf_counter() - start

    times = {"dense": [], "packed": []}
    step(mask), step(params)  # warm up
    for _ in range(reps):
        times["dense"].append(step(mask))
        times["packed"].append(step(params))
    dense, packed = (statistics.median(times[k]) for k in ("dense", "packed"))
    return {
        "seq": seq,
        "backend": backend,
        "documents": len(params.segments()),
        "longest": params.max_seqlen_q,
        "dense_ms": round(1e3 * dense, 2),
        "packed_ms": round(1e3 * packed, 2),
        "packed_over_dense_time": round(packed / dense, 3),
        "dense_saved_bytes": saved_bytes(lambda: run(mask)),
        "packed_saved_bytes": saved_bytes(lambda: run(params)),
        "mask_bytes": mask.numel() * mask.element_size(),
        "cu_seqlens_bytes": params.cu_seqlens_q.numel() * params.cu_seqlens_q.element_size(),
    }


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = [measure(seq, backend, args.reps) for seq in args.seq for backend in ("fused", "blocked")]
    result = {
        "command": "python bench/packed_sequences.py " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "rows": rows,
    }
    for r in rows:
        print(json.dumps(r))
    path = os.path.join(HERE, "results", "packed_sequences.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()

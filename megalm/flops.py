"""Model FLOPs per iteration (Megatron's accounting), device peak FLOP/s, and MFU.

Model FLOPs (activation recomputation excluded; causal attention counted fully), for ``B``
sequences of length ``s``, ``L`` layers, hidden ``h``, ``n`` heads of size ``d`` (query
projection ``n d``), ``g`` key/value groups, MLP width ``f``, padded vocabulary ``V``::

    FLOPs = 12 B s L h^2 [ (1 + g/n + s/h) (n d / h)       # QKV + output projections, QK^T and AV
                           + (f/h) k c                      # MLP: c = 3/2 with SwiGLU (3 matrices)
                           + f_shared/h c                   # MoE shared experts (0 for dense)
                           + V / (2 L h) ]                  # logits

Sliding-window layers (``--window-size w,0``, gpt-oss) see at most ``w + 1`` keys per query: their
``s/h`` term becomes ``min(s, w + 1)/h`` (the full-square convention above, applied to the window).
Softmax sinks add one score per query row and head (``O(B s n)``): not counted.

``12 = 3 (forward, weight grad, input grad) x 2 (two GEMMs of each size) x 2 (multiply-add)``;
``k`` is the number of experts each token is routed to (1 for a dense MLP).  Multi-latent attention
replaces the attention term by :func:`mla_flops_per_token`; ``--mtp-num-layers D`` adds D layers like
the last one, their norms and ``eh_proj``, and D more logits GEMMs (Megatron's accounting).  Dense GPT without
GQA and ``f = 4h`` reduces to ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))``.

MoE hook: :func:`transformer_flops` takes ``moe_router_topk``, ``moe_ffn_hidden_size``,
``num_moe_layers`` and ``shared_expert_ffn_hidden_size``; :func:`num_floating_point_operations`
reads them from the model config when such fields exist (``num_experts``, ``moe_router_topk``,
``moe_ffn_hidden_size``, ``moe_layer_freq``, ``moe_shared_expert_intermediate_size``).
"""

from __future__ import annotations

import functools
import time
from typing import Optional, Tuple

import torch

from megalm.config.gptoss import layer_window
from megalm.config.sections import MegalmConfig

# Dense peak FLOP/s per device (no sparsity).  "fp32" is the non-tensor-core rate, "tf32" the
# tensor-core rate used by fp32 matmuls when torch allows TF32.
DEVICE_PEAK_FLOPS = {
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51.2e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}

_DTYPE_KEY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def transformer_flops(
    batch_size: float,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int,
    vocab_size: int,
    num_query_groups: Optional[int] = None,
    kv_channels: Optional[int] = None,
    swiglu: bool = False,
    moe_router_topk: int = 1,
    moe_ffn_hidden_size: Optional[int] = None,
    num_moe_layers: int = 0,
    shared_expert_ffn_hidden_size: int = 0,
    attention_flops_per_token: Optional[float] = None,
    mtp_num_layers: int = 0,
    window_size: Optional[int] = None,
    num_window_layers: int = 0,
) -> float:
    """Model FLOPs of one iteration over ``batch_size`` sequences (see the module docstring).
    ``attention_flops_per_token``: one layer's attention FLOPs per token (forward and backward) in place of
    the multi-head formula (multi-latent attention, :func:`mla_flops_per_token`); ``mtp_num_layers``: the
    multi-token prediction depths, counted in ``num_layers`` / ``num_moe_layers`` by the caller, add their
    norms, ``eh_proj`` and one more logits GEMM each; ``num_window_layers`` of the ``num_layers`` attend
    within ``window_size`` keys to the left."""
    h, L, s = float(hidden_size), num_layers, float(seq_length)
    heads = num_attention_heads
    groups = num_query_groups or heads
    head_dim = kv_channels or hidden_size // heads
    gated = 1.5 if swiglu else 1.0
    keys = s if window_size is None else (s * (L - num_window_layers) + min(s, window_size + 1) * num_window_layers) / L
    attention = (1.0 + groups / heads + keys / h) * (heads * head_dim / h)
    if attention_flops_per_token is not None:
        attention = attention_flops_per_token / (12.0 * h * h)
    dense_layers = L - num_moe_layers
    moe_ffn = moe_ffn_hidden_size or ffn_hidden_size
    mlp_total = (
        (dense_layers * ffn_hidden_size + num_moe_layers * (moe_router_topk * moe_ffn + shared_expert_ffn_hidden_size))
        * gated
        / h
    )
    mlp = mlp_total / L  # mean per layer
    logits = vocab_size * (1 + mtp_num_layers) / (2.0 * L * h)
    mtp = mtp_num_layers * (3 * h + 2 * h * h) / (2.0 * L * h * h)  # 6 (3 norms + eh_proj [h, 2h]) per token
    return 12.0 * batch_size * s * L * h * h * (attention + mlp + logits + mtp)


def mla_flops_per_token(m) -> float:
    """Forward + backward FLOPs per token of one multi-latent attention layer (Megatron's accounting, the
    causal core counted fully as in :func:`transformer_flops`): ``6 x`` the weights a token multiplies
    (query down / up or direct projection, key/value down and up, the RoPE key, output projection; ``+1``
    per latent norm) plus ``6 s n (d_qk + d_v)`` for ``QK^T`` and ``AV``."""
    h, n, s = m.hidden_size, m.num_attention_heads, m.seq_length
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank is None:
        q = h * n * q_head
    else:
        q = m.q_lora_rank * (h + n * q_head + 1)
    kv = m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
    out = n * m.v_head_dim * h
    core = s * n * (q_head + m.v_head_dim)
    return 6.0 * (q + kv + out + core)


def num_floating_point_operations(cfg, batch_size: float) -> float:
    """Model FLOPs per iteration for ``batch_size`` sequences from a MegalmConfig or ModelConfig."""
    m = cfg.model if isinstance(cfg, MegalmConfig) else cfg
    vocab = m.padded_vocab_size or m.vocab_size
    if vocab is None:
        raise ValueError("num_floating_point_operations needs the vocabulary size (set_vocab_size first)")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    num_moe_layers, topk, moe_ffn, shared = 0, 1, None, 0
    mtp = getattr(m, "mtp_num_layers", None) or 0
    if m.num_experts:
        freq = m.moe_layer_freq or 1
        pattern = [i % int(freq) == 0 for i in range(m.num_layers)] if isinstance(freq, int) else list(freq)
        num_moe_layers = int(sum(pattern)) + (mtp if pattern[-1] else 0)  # MTP layers are like the last one
        topk = m.moe_router_topk or 1
        moe_ffn = m.moe_ffn_hidden_size
        shared = m.moe_shared_expert_intermediate_size or 0
    return transformer_flops(
        batch_size,
        m.seq_length,
        m.num_layers + mtp,
        m.hidden_size,
        m.num_attention_heads,
        ffn,
        vocab,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        kv_channels=m.kv_channels,
        swiglu=m.gated_linear_unit,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        num_moe_layers=num_moe_layers,
        shared_expert_ffn_hidden_size=shared,
        window_size=m.window_size[0] if m.window_size and m.window_size[0] >= 0 else None,
        num_window_layers=sum(layer_window(m, i) is not None for i in range(m.num_layers)),
        attention_flops_per_token=mla_flops_per_token(m) if getattr(m, "multi_latent_attention", False) else None,
        mtp_num_layers=mtp,
    )


# --- device peaks ---------------------------------------------------------------------------------


def _table_entry(device_name: str) -> Optional[dict]:
    name = device_name.upper()
    if "H200" in name:
        return DEVICE_PEAK_FLOPS["H200"]
    if "H100" in name:
        return DEVICE_PEAK_FLOPS["H100 PCIe" if "PCIE" in name else "H100 SXM"]
    if "A100" in name:
        return DEVICE_PEAK_FLOPS["A100"]
    return None


def _dtype_key(dtype: torch.dtype) -> str:
    key = _DTYPE_KEY.get(dtype, "fp32")
    if key == "fp32" and torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return key


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has fast bf16 kernels on this CPU (AVX512-BF16 or AMX); without them a bf16
    matmul ran at ~1 GFLOP/s where fp32 ran at ~190 (an AVX2-only machine)."""
    return _mkldnn_supports("_is_mkldnn_bf16_supported")


def cpu_has_native_half(dtype: torch.dtype) -> bool:
    """bf16 as :func:`cpu_has_native_bf16`; fp16 likewise (AVX512-FP16 or AMX-FP16); fp32: True."""
    if dtype == torch.bfloat16:
        return cpu_has_native_bf16()
    if dtype == torch.float16:
        return _mkldnn_supports("_is_mkldnn_fp16_supported")
    return True


def _mkldnn_supports(check_name: str) -> bool:
    check = getattr(getattr(torch.ops, "mkldnn", None), check_name, None)
    try:
        return bool(check()) if check is not None else True
    except Exception:  # noqa: BLE001 - an odd build: assume yes, the MFU line shows the truth
        return True


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 10, device: Optional[torch.device] = None
) -> float:
    """Best FLOP/s of ``repeats`` timed ``n x n @ n x n`` matmuls (after warming up: one matmul, and
    0.5 s of them on CPU, where a cold thread pool read ~1.6x low).

    Measured once per process for each ``(dtype, n, repeats, device, threads)``: a fact about the
    hardware, kept for the process's lifetime (as a lazily loaded library is) so that every
    training run of a process does not pay a second of matmuls; ``measure_matmul_flops.cache_clear()``
    forgets the measurements (bench/throughput_report.py measures several times)."""
    device = device or torch.device("cpu")
    return _measure(dtype, n, repeats, str(device), torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measure(dtype: torch.dtype, n: int, repeats: int, device_name: str, threads: int) -> float:
    device = torch.device(device_name)
    # A generator of its own: drawing from the global one would shift the training's random streams
    # (dropout) in the first run of a process only, the measurement being kept.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    warm_until = time.perf_counter() + (0.5 if device.type == "cpu" else 0.0)
    torch.matmul(a, b)
    while time.perf_counter() < warm_until:  # CPU: thread pool and clocks come up to speed
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


measure_matmul_flops.cache_clear = _measure.cache_clear


def device_peak_flops(
    dtype: torch.dtype = torch.bfloat16, override: Optional[float] = None, device: Optional[torch.device] = None
) -> Tuple[float, str]:
    """``(peak FLOP/s per device, source)``; source is ``"override"``, ``"table: <name> <dtype>"``
    or ``"measured: <n>^3 matmul"`` (CPU, or a GPU not in the table)."""
    if override:
        return float(override), "override"
    device = device or (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        entry = _table_entry(name)
        key = _dtype_key(dtype)
        if entry is not None and key in entry:
            return entry[key], f"table: {name} {key}"
    n = 1024
    if device.type == "cpu" and not cpu_has_native_half(dtype):
        # Half-precision matmuls without native instructions run ~100x below fp32 (seconds per
        # measurement): the machine's peak is its fp32 one, and MFU says how much of it is used.
        return (
            measure_matmul_flops(torch.float32, n=n, device=device),
            f"measured: {n}^3 fp32 matmul (this CPU has no native {_DTYPE_KEY.get(dtype, dtype)} instructions)",
        )
    return measure_matmul_flops(dtype, n=n, device=device), f"measured: {n}^3 {_DTYPE_KEY.get(dtype, dtype)} matmul"


def tflops_per_rank(flops_per_iteration: float, iteration_time_s: float, world_size: int) -> float:
    """Achieved model TFLOP/s per rank (Megatron's 'throughput per GPU')."""
    return flops_per_iteration / (iteration_time_s * world_size * 1e12)


def mfu(flops_per_iteration: float, iteration_time_s: float, world_size: int, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s per rank / peak FLOP/s per device."""
    return flops_per_iteration / (iteration_time_s * world_size) / peak_flops

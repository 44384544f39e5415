"""``megalm-plan --calibrate``: measure the cluster's rates and write them into the cluster file.

Run on every rank of the cluster at once (torchrun; on the simulated cluster through
``tools/cluster/run.py``, so that its shaped links and shared cores are in the numbers)::

    python3 -m megalm.planner.calibrate --out cluster.toml [--dtype bf16]

Every rank measures at the same time (as in training, every rank computes at once), and compute rates are
sustained rates over windows of 1.5 s, not the best call: where ranks share cores (the simulated cluster: every
rank on this host's cores, under its CPU quota) training runs at the shared rate, which a lucky call would hide:

* GEMM throughput by size (``n x n @ n x n`` for n = 64 ... 2048; on CUDA up to 8192): ``[gemm_tflops]``;
* the attention core (causal SDPA, forward + backward, counted as Megatron-LM counts it) against the
  GEMM peak: ``attention_efficiency``;
* elementwise bandwidth (an add over 64 MB: two reads, one write): ``memory_bandwidth_gbps``;
* the optimizer step: torch's Adam (multi-tensor, as megalm's optimizer runs it) over 16 tensors of 2^16
  elements, per element: ``optimizer_ns_per_param``; on CUDA the same on host tensors
  (``host_optimizer_ns_per_param``, the --optimizer-cpu-offload step) and a pinned host-to-device copy of
  64 MB (``host_link_gbps``); on a CPU device the host is the device (offload copies run at memory bandwidth);
* per-layer overhead: one tiny transformer-shaped block (hidden 32, 8 tokens) forward + backward, whose
  arithmetic is negligible: ``layer_overhead_us``;
* on a CPU device, ``host_cores``: the cores every rank shares (this host's; the pipeline bubble's cores serve
  the busy stages), and with ``--inter-node-rate`` the shaper's ``inter_node_burst_bytes``;
* collectives: all-reduce of 4 KB and 8 MB over pairs of ranks on one node (intra) and over one rank of
  each node (inter; all pairs of a node at once, as the data-parallel groups of a layout run):
  latency from the small one, bandwidth from the difference, per direction (a 2-rank all-reduce of ``B``
  sends ``B``); the inter-node figure is per node (concurrent senders multiplied in).

Rank 0 writes the merged cluster file (medians over ranks; the slowest rank's GEMM table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict

import torch


def _best(
    fn: Callable[[], None],
    repeats: int = 5,
    warm: float = 0.2,
    sync: Callable[[], None] = lambda: None,
    budget: float = 1.5,
    reduce=None,
    start: Callable[[], None] = lambda: None,
) -> float:
    """Seconds per call: by default the mean over a continuous window of at least ``budget`` seconds (and
    ``repeats`` calls) after ``warm`` seconds of warm-up, every rank starting together (``start``: a barrier): a
    sustained rate, which sees the cores other ranks share and a CPU quota's throttling (a 2-CPU cgroup on a
    larger host runs a short call at full speed and then waits; the best or median call time hides that).
    ``reduce`` (e.g. ``statistics.median``) times calls one by one instead (collectives)."""
    until = time.perf_counter() + warm
    fn()
    while time.perf_counter() < until:
        fn()
    if reduce is None:
        start()
        sync()
        t0, count = time.perf_counter(), 0
        while count < repeats or time.perf_counter() - t0 < budget:
            fn()
            count += 1
        sync()
        return (time.perf_counter() - t0) / count
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return reduce(times)


def compute_rates(
    device: torch.device, dtype: torch.dtype, start: Callable[[], None] = lambda: None
) -> Dict[str, object]:
    """GEMM table, attention efficiency, elementwise bandwidth and per-layer overhead on this rank;
    ``start``: called before each timed window (``dist.barrier`` under torchrun: every rank starts
    together)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sizes = [64, 128, 256, 512, 1024, 2048] + ([4096, 8192] if device.type == "cuda" else [])
    gemm = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        sec = _best(lambda: torch.matmul(a, b), sync=sync, start=start)
        gemm[f"{2.0 * n**3:.3g}"] = 2.0 * n**3 / sec / 1e12
    peak = max(gemm.values())
    # Attention: b=2, heads 4, s=256, d=64 (CPU), larger on CUDA; forward + backward, causal, counted whole.
    bsz, heads, s, d = (2, 4, 256, 64) if device.type == "cpu" else (4, 16, 2048, 128)
    q, k, v = (torch.randn(bsz, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    sec = _best(attention, sync=sync, start=start)
    attention_eff = 3 * 4 * bsz * heads * s * s * d / sec / (peak * 1e12)
    n = 16 * 2**20
    x, y = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
    sec = _best(lambda: torch.add(x, y), sync=sync, start=start)
    bandwidth = 3 * n * x.element_size() / sec / 1e9
    overhead = layer_overhead_s(device, dtype, sync, start)
    optimizer = optimizer_s_per_param(device, sync, start=start)
    host = {
        "optimizer_ns_per_param": optimizer * 1e9,
        "host_optimizer_ns_per_param": optimizer * 1e9,
        "host_link_gbps": bandwidth,
    }
    if device.type == "cuda":
        host["host_optimizer_ns_per_param"] = (
            optimizer_s_per_param(torch.device("cpu"), lambda: None, start=start) * 1e9
        )
        src = torch.empty(32 * 2**20, dtype=torch.float16).pin_memory()
        dst = torch.empty_like(src, device=device)
        sec = _best(lambda: dst.copy_(src, non_blocking=True), sync=sync, start=start)
        host["host_link_gbps"] = src.numel() * src.element_size() / sec / 1e9
    return host | {
        "gemm_tflops": gemm,
        "peak_tflops": peak,
        "attention_efficiency": min(1.0, attention_eff),
        "memory_bandwidth_gbps": bandwidth,
        "layer_overhead_us": overhead * 1e6,
    }


def optimizer_s_per_param(
    device: torch.device, sync, tensors: int = 16, numel: int = 2**16, start: Callable[[], None] = lambda: None
) -> float:
    """Seconds of one Adam step (foreach, fp32 state) per element, over ``tensors`` tensors of ``numel``."""
    params = [torch.zeros(numel, device=device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, device=device)
    opt = torch.optim.Adam(params, lr=1e-4, foreach=True)
    return _best(opt.step, sync=sync, start=start) / (tensors * numel)


def layer_overhead_s(device: torch.device, dtype: torch.dtype, sync, start: Callable[[], None] = lambda: None) -> float:
    """Forward + backward seconds of one tiny transformer layer (megalm's own), arithmetic negligible."""
    from megalm.config import MegalmConfig
    from megalm.parallel_state import ProcessGroups
    from megalm.transformer.transformer_layer import TransformerLayer

    cfg = MegalmConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 1, 32, 4, 128
    m.kv_channels = 8
    m.seq_length = m.max_position_embeddings = 8
    m.hidden_dropout = m.attention_dropout = 0.0
    layer = TransformerLayer(m, 0, ProcessGroups.single()).to(device=device, dtype=dtype)
    x = torch.randn(8, 1, 32, device=device, dtype=dtype, requires_grad=True)

    def step():
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()

    return _best(step, repeats=9, sync=sync, start=start)


def collective_rates(per_node: int) -> Dict[str, float]:
    """Intra- and inter-node all-reduce latency (us) and bandwidth (GB/s per direction); collective."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    nodes = world // per_node
    out: Dict[str, float] = {}
    plans = []
    if per_node > 1:  # pairs (0,1), (2,3) ... inside every node
        plans.append(("intra", [[r, r + 1] for r in range(0, world, 2) if (r // per_node) == ((r + 1) // per_node)]))
    if nodes > 1:  # local rank i of node 0 with local rank i of node 1, ... (every local rank at once)
        plans.append(("inter", [[i, per_node + i] for i in range(per_node)] if nodes >= 2 else []))
    for name, pairs in plans:
        groups = [dist.new_group(p) for p in pairs]
        mine = next((g for g, p in zip(groups, pairs) if rank in p), None)
        results = []
        for nbytes in (4096, 8 * 2**20):
            buf = torch.ones(nbytes // 4)
            dist.barrier()
            sec = 0.0
            if mine:
                op = lambda: dist.all_reduce(buf, group=mine)  # noqa: E731
                sec = _best(op, repeats=5, warm=0.0, budget=0.0, reduce=statistics.median)
            dist.barrier()
            results.append(sec)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        times = [g for g, r in zip(gathered, range(world)) if any(r in p for p in pairs)]
        small = statistics.median(t[0] for t in times)
        large = statistics.median(t[1] for t in times)
        # A 2-rank all-reduce of B bytes sends B per rank in 2 ring steps.
        out[f"{name}_node_latency_us"] = small / 2 * 1e6
        rate = (8 * 2**20 - 4096) / max(large - small, 1e-9) / 1e9
        out[f"{name}_node_bandwidth_gbps"] = rate * (len(pairs) if name == "inter" else 1)
    return out


def _tiny_model(
    cfg, pre_process: bool = True, post_process: bool = True, layer_numbers=None, *, process_groups, rng_tracker
):
    from megalm.models import GPTModel

    return GPTModel(
        cfg,
        pre_process=pre_process,
        post_process=post_process,
        layer_numbers=layer_numbers,
        process_groups=process_groups,  # the Trainer's (model_provider's contract)
        rng_tracker=rng_tracker,
    )


def _tiny_forward_step(data_iterator, model):
    """pretrain_gpt.py's forward step, reduced to the mean token loss (the calibration trains 2 iterations of a
    tiny model only to hold what a training process holds)."""
    from megalm.distributed.finalize_model_grads import unwrap_model
    from megalm.training import get_batch

    gpt = unwrap_model(model)
    batch = get_batch(data_iterator, gpt.cfg, gpt.process_groups)
    out = model(
        batch["tokens"],
        batch["position_ids"],
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        attention_mask=batch["attention_mask"],
        packed_seq_params=batch["packed_seq_params"],
    )

    def loss(output):
        total, count = (output.float().reshape(-1) * batch["loss_mask"].reshape(-1)).sum(), batch["loss_mask"].sum()
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return out, loss


def baseline_rss_bytes(train: bool = False) -> int:
    """This process's resident bytes now (CPU: the part of a rank's peak RSS that is not the model's tensors:
    interpreter, torch, megalm, process groups; the planner's ``reserve_gb``).  With ``train``, after two
    iterations of a ~30k-parameter GPT through :func:`megalm.training.pretrain` on every rank (its process groups, data
    pipeline and buffers, whose own tensors are ~1 MB): a training process's baseline, not an idle one's."""
    import gc

    import megalm.training.training  # noqa: F401 - what pretrain_gpt.py loads

    if train:
        from megalm import parallel_state
        from megalm.training import pretrain

        tiny = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16"
        tiny += " --vocab-size 64 --mock-data --num-workers 0 --micro-batch-size 1 --lr 1e-3 --train-iters 2"
        tiny += " --eval-iters 0 --log-interval 1"
        pretrain(_tiny_model, _tiny_forward_step, argv=tiny.split())
        parallel_state.destroy_model_parallel()
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Measure this cluster's rates for megalm-plan (run under torchrun)")
    p.add_argument("--out", required=True, help="cluster TOML to write (its other keys are kept)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--base", default=None, help="cluster preset or file the measurements update (default: --out)")
    p.add_argument(
        "--inter-node-burst-bytes",
        type=float,
        default=None,
        help="the node links' token-bucket burst (the simulated cluster's tc tbf; megalm-plan passes it)",
    )
    args = p.parse_args(argv)
    import torch.distributed as dist

    from megalm.planner.cluster import dump_cluster, load_cluster

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rates = compute_rates(device, dtype, start=dist.barrier if distributed else (lambda: None))
    world = dist.get_world_size() if distributed else 1
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    links = collective_rates(per_node) if distributed and world > 1 else {}
    rates["reserve_gb"] = baseline_rss_bytes(train=distributed and not cuda) / 1e9
    if distributed:
        every = [None] * world
        dist.all_gather_object(every, rates)
    else:
        every = [rates]
    if not distributed or dist.get_rank() == 0:
        merged = {k: statistics.median(r[k] for r in every) for k in rates if k != "gemm_tflops"}
        slowest = min(every, key=lambda r: r["peak_tflops"])
        merged["gemm_tflops"] = slowest["gemm_tflops"]
        merged.update(links)
        merged["nodes"], merged["devices_per_node"] = world // per_node, per_node
        merged["backend"] = "nccl" if cuda else "gloo"
        merged["device"] = "cuda" if cuda else "cpu"
        if not cuda:  # every rank of a CPU calibration (the simulated cluster) runs on this host's cores
            merged["host_cores"] = len(os.sched_getaffinity(0))
        if args.inter_node_burst_bytes is not None:
            merged["inter_node_burst_bytes"] = args.inter_node_burst_bytes
        base = args.base or (args.out if os.path.exists(args.out) else ("h100" if cuda else "cpu-sim"))
        cluster = load_cluster(base, merged)
        with open(args.out, "w") as f:
            f.write(dump_cluster(cluster))
        print("CALIBRATED " + json.dumps(merged))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()  # errors raise (non-zero exit); the library does not exit itself

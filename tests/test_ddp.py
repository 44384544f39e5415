"""DistributedDataParallel, gradient buffers and finalize_model_grads on real gloo ranks.

Data-parallel training with gradient accumulation must reproduce single-process training on
the whole global batch: same gradients after the reduction, same parameters after N AdamW
steps (with clipping active), and no communication at all during non-last microbatches.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import ParallelConfig
from megalm.distributed import CommStats, DistributedDataParallel, finalize_model_grads
from megalm.optimizer import build_optimizer
from megalm.parallel_state import get_process_groups
from tests.configs import optimizer_config
from tests.distributed_harness import run_distributed

GLOBAL_BATCH, NUM_MICRO, STEPS = 24, 3, 3
LR, WD, CLIP = 1e-3, 0.1, 0.05


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 3)  # 99 elements: the first bucket needs padding

    def forward(self, x):
        return self.out(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyMLP()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


# The optimizer settings of the reference run, for build_optimizer.
OPTIMIZER = dict(lr=LR, weight_decay=WD, clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.95)


# --- single-process reference ----------------------------------------------------------------


def reference_run():
    model = make_model()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    grads, norms = None, []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()], norms


# --- distributed run --------------------------------------------------------------------------


class CallCounter:
    """Counts torch.distributed collectives independently of megalm's own counter."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_gather")

    def __init__(self):
        self.calls = 0
        self.originals = {n: getattr(dist, n) for n in self.NAMES}

    def __enter__(self):
        for n, fn in self.originals.items():
            setattr(dist, n, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def counted(*a, **k):
            self.calls += 1
            return fn(*a, **k)

        return counted

    def __exit__(self, *exc):
        for n, fn in self.originals.items():
            setattr(dist, n, fn)


def _check_layout(ddp, dp):
    for buf in ddp.all_buffers:
        cursor = 0
        for bucket in buf.buckets:
            assert bucket.numel % dp == 0 and bucket.offset == cursor
            cursor += bucket.numel
            assert bucket.numel - bucket.numel_unpadded < dp
            for p in bucket.params:
                s, e = bucket.param_ranges[p]
                assert e - s == p.numel() and p.main_grad.data_ptr() == buf.grad_data[bucket.offset + s :].data_ptr()
        order = [buf.param_index_map[p][0] for p in buf.params]
        assert order == sorted(order)  # buffer order is reversed module order
    return sum(len(b.buckets) for b in ddp.all_buffers)


def _train(dp, overlap, bucket_size, expert_last_layer, stats):
    model = make_model()
    if expert_last_layer:
        for p in model.out.parameters():
            p.allreduce = False
    ddp = DistributedDataParallel(
        model,
        ParallelConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket_size),
        process_groups=get_process_groups(),
        comm_stats=stats,
    )
    n_buckets = _check_layout(ddp, dp)
    optimizer = build_optimizer(
        optimizer_config(OPTIMIZER), [ddp], process_groups=get_process_groups(), comm_stats=stats
    )
    rank, mb = parallel_state.get_data_parallel_rank(), GLOBAL_BATCH // dp // NUM_MICRO
    out = {
        "n_buckets": n_buckets,
        "nosync_calls": 0,
        "nosync_megalm_calls": 0,
        "launched_in_backward": [],
        "norms": [],
        "grad_freed": True,
    }
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.view(dp, NUM_MICRO, mb, 8)[rank], y.view(dp, NUM_MICRO, mb, 3)[rank]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        before = stats.total_calls()
        with CallCounter() as counter:
            for k in range(NUM_MICRO - 1):
                with ddp.no_sync():
                    (F.mse_loss(ddp(x[k]), y[k]) / NUM_MICRO).backward()
        out["nosync_calls"] += counter.calls
        out["nosync_megalm_calls"] += stats.total_calls() - before
        with CallCounter() as counter:
            (F.mse_loss(ddp(x[-1]), y[-1]) / NUM_MICRO).backward()
        out["launched_in_backward"].append(counter.calls)
        out["grad_freed"] &= all(p.grad is None for p in model.parameters())
        finalize_model_grads([ddp], process_groups=get_process_groups(), comm_stats=stats)
        if step == 0:
            out["grads"] = [p.main_grad.numpy().copy() for p in model.parameters()]
        ok, norm, _ = optimizer.step()
        assert ok
        out["norms"].append(norm)
    out["params"] = [p.detach().numpy().copy() for p in model.parameters()]  # tensors cannot cross
    return out  # processes after exit


def _finalize_checks():
    """Sequence-parallel (TP 2) and tied-embedding (PP 2) gradient reductions on 2 ranks."""
    rank, results = dist.get_rank(), {}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    m = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    for p in m[0].parameters():
        p.sequence_parallel = True
    ddp = DistributedDataParallel(m, ParallelConfig(), process_groups=get_process_groups())
    for p in m.parameters():
        p.main_grad.fill_(rank + 1.0)
    finalize_model_grads([ddp], process_groups=get_process_groups())
    results["sp"] = [p.main_grad.flatten()[0].item() for p in m.parameters()]

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    for tied in (True, False):
        if rank == 0:
            stage = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
            stage[0].weight.vocab_unpadded = 10
            stage[0].weight.shared_embedding = True  # Megatron marks both copies
        else:
            stage = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 10, bias=False))
            stage[1].weight.shared_embedding = tied
        ddp = DistributedDataParallel(stage, ParallelConfig(), process_groups=get_process_groups())
        for p in stage.parameters():
            p.main_grad.fill_(rank + 1.0)
        finalize_model_grads([ddp], process_groups=get_process_groups())
        results[f"tied={tied}"] = [p.main_grad.flatten()[0].item() for p in stage.parameters()]
    return results


def ddp_worker(dp, with_finalize):
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for overlap, bucket, expert in ((False, None, False), (False, 100, False), (True, 100, False), (True, 100, True)):
        stats = CommStats()
        results[(overlap, bucket, expert)] = _train(dp, overlap, bucket, expert, stats)
        results[(overlap, bucket, expert)]["stats"] = stats.get()
    if with_finalize:
        results["finalize"] = _finalize_checks()
    return results


def _assert_close(actual, expected, what):
    for a, e in zip(actual, expected):
        a = torch.from_numpy(a)
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6 * e.abs().max().item(), msg=what)


@pytest.mark.parametrize("dp", [2, 4])
def test_ddp_matches_single_process(dp):
    ref_grads, ref_params, ref_norms = reference_run()
    assert min(ref_norms) > CLIP  # clipping is active in every step
    ranks = run_distributed(ddp_worker, dp, args=(dp, dp == 2), timeout=150)
    for key, res in ranks[0].items():
        if key == "finalize":
            continue
        overlap, bucket, expert = key
        for r in ranks:  # every rank holds the same parameters
            for a, b in zip(r[key]["params"], res["params"]):
                assert (a == b).all()
        _assert_close(res["grads"], ref_grads, f"grads {key}")
        _assert_close(res["params"], ref_params, f"params {key}")
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-6)
        assert res["nosync_calls"] == 0 and res["nosync_megalm_calls"] == 0
        assert res["grad_freed"]
        n_buckets = res["n_buckets"]
        assert n_buckets == (1 if bucket is None else 3)
        # with overlap every bucket is launched during the last backward; without, none is
        assert res["launched_in_backward"] == [n_buckets if overlap else 0] * STEPS
        assert res["stats"]["grad_all_reduce"]["calls"] == n_buckets * STEPS
        padded_bytes = sum(4 * p.numel() for p in ref_params) + 4 * ((-99) % dp)
        assert res["stats"]["grad_all_reduce"]["tensor_bytes"] >= padded_bytes * STEPS
        assert res["stats"]["grad_all_reduce"]["wire_bytes"] == pytest.approx(
            2 * (dp - 1) / dp * res["stats"]["grad_all_reduce"]["tensor_bytes"]
        )
    if dp == 2:
        fin = [r["finalize"] for r in ranks]
        assert fin[0]["sp"] == [3.0, 3.0, 1.0, 1.0] and fin[1]["sp"] == [3.0, 3.0, 2.0, 2.0]
        # tied: first stage's embedding and last stage's shared copy are summed; nothing else moves
        assert fin[0]["tied=True"] == [3.0, 1.0, 1.0] and fin[1]["tied=True"] == [2.0, 2.0, 3.0]
        assert fin[0]["tied=False"] == [1.0, 1.0, 1.0] and fin[1]["tied=False"] == [2.0, 2.0, 2.0]


def test_buffer_layout_single_process():
    model = make_model()
    ddp = DistributedDataParallel(model, ParallelConfig(ddp_bucket_size=99), process_groups=get_process_groups())
    names = [[n for n, p in model.named_parameters() if any(p is q for q in b.params)] for b in ddp.buffers[0].buckets]
    assert names == [
        ["out.weight", "out.bias"],
        ["fc2.weight", "fc2.bias"],
        ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias"],
    ]
    ranges = ddp.bucket_ranges()
    assert ranges["out.bias"] == (0, 0, 3, 0) and ranges["out.weight"] == (0, 3, 99, 0)
    x = torch.randn(5, 8)
    ddp(x).sum().backward()
    ddp(x).sum().backward()  # without DDP communication (DP 1) accumulation is plain summation
    ref = copy.deepcopy(make_model())
    (2 * ref(x).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, q.grad)
    ddp.zero_grad_buffer()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())


def test_param_buffer_for_distributed_optimizer_and_misuse_error():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(
        model, ParallelConfig(use_distributed_optimizer=True, ddp_bucket_size=99), process_groups=get_process_groups()
    )
    buf = ddp.buffers[0]
    for p, b in zip(model.parameters(), before):
        s, e, _ = buf.param_index_map[p]
        assert torch.equal(p, b) and p.data_ptr() == buf.param_data[s:].data_ptr()  # params live in the buffer
    ddp = DistributedDataParallel(
        make_model(), ParallelConfig(overlap_grad_reduce=True, ddp_bucket_size=99), process_groups=get_process_groups()
    )
    x = torch.randn(5, 8)
    ddp(x).sum().backward()  # buckets are "reduced" during this backward (DP 1: no communication)
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp(x).sum().backward()  # a second backward outside no_sync() would add to reduced buckets
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        ddp(x).sum().backward()
    ddp(x).sum().backward()
    ddp.finish_grad_sync()

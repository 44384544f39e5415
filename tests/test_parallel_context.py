"""Layers on explicitly created process groups, without ``initialize_model_parallel``, and the
in-place reductions of the mappings.

One 4-rank spawned group (gloo) builds its own groups with ``dist.new_group``: tensor-parallel
pairs ``[0, 1] [2, 3]`` and expert-parallel pairs ``[0, 2] [1, 3]``; parallel_state is never
initialized (so a layer that read it would see TP 1 and fail the shape and value checks).
Every check returns measured errors; the assertions run in the test process.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalm import parallel_state
from megalm.config import parse_config
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel import mappings
from megalm.tensor_parallel.initialization import initialize_weights
from megalm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalm.tensor_parallel.utils import shard_of_full
from megalm.transformer.moe import MoELayer
from tests.configs import make_config, parallel_config
from tests.distributed_harness import run_distributed
from tests.training_runs import tiny_flags

S, B, H, OUT = 4, 2, 8, 6
TIMEOUT = timedelta(seconds=60)
# The tiny GPT's flags with a 4-expert MoE (hidden H, S tokens, no load balancing loss).
MOE = tiny_flags(
    hidden_size=H,
    num_attention_heads=2,
    seq_length=S,
    vocab_size=64,
    num_experts=4,
    moe_ffn_hidden_size=12,
    moe_router_load_balancing_type="none",
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _groups():
    """``(tp, ep)``: this rank's groups (every rank creates every group, in the same order)."""
    made = {}
    for name, lists in (("tp", [[0, 1], [2, 3]]), ("ep", [[0, 2], [1, 3]])):
        for members in lists:
            group = dist.new_group(members, timeout=TIMEOUT)
            if dist.get_rank() in members:
                made[name] = group
    return made["tp"], made["ep"]


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


# --- layers ----------------------------------------------------------------------------------


def _check_column(tp, sp: bool) -> dict:
    r = dist.get_rank(tp)
    layer = ColumnParallelLinear(H, OUT, bias=True, sequence_parallel=sp, tp_group=tp)
    w_full, b_full = _rand(OUT, H, seed=1), _rand(OUT, seed=2)
    with torch.no_grad():
        layer.weight.copy_(shard_of_full(w_full, 0, r, 2))
        layer.bias.copy_(shard_of_full(b_full, 0, r, 2))
    x_full, up_full = _rand(S, B, H, seed=3), _rand(S, B, OUT, seed=4)
    x = (x_full.chunk(2, 0)[r] if sp else x_full).clone().requires_grad_()
    out = layer(x)
    (out * up_full.chunk(2, -1)[r]).sum().backward()
    ref_x, ref_w, ref_b = (t.clone().requires_grad_() for t in (x_full, w_full, b_full))
    ref = F.linear(ref_x, ref_w, ref_b)
    (ref * up_full).sum().backward()
    name = f"column sp={sp}"
    dx = _gather(x.grad, tp, 0) if sp else x.grad
    return {
        f"{name} out": _rel(out, ref.chunk(2, -1)[r]),
        f"{name} dx": _rel(dx, ref_x.grad),
        f"{name} dW": _rel(layer.weight.grad, ref_w.grad.chunk(2, 0)[r]),
        f"{name} db": _rel(layer.bias.grad, ref_b.grad.chunk(2, 0)[r]),
    }


def _check_row(tp, sp: bool) -> dict:
    r = dist.get_rank(tp)
    layer = RowParallelLinear(OUT, H, bias=True, sequence_parallel=sp, tp_group=tp)
    w_full, b_full = _rand(H, OUT, seed=5), _rand(H, seed=6)
    with torch.no_grad():
        layer.weight.copy_(shard_of_full(w_full, 1, r, 2))
        layer.bias.copy_(b_full)
    x_full, up_full = _rand(S, B, OUT, seed=7), _rand(S, B, H, seed=8)
    x = x_full.chunk(2, -1)[r].clone().requires_grad_()
    out = layer(x)
    (out * (up_full.chunk(2, 0)[r] if sp else up_full)).sum().backward()
    ref_x, ref_w, ref_b = (t.clone().requires_grad_() for t in (x_full, w_full, b_full))
    ref = F.linear(ref_x, ref_w, ref_b)
    (ref * up_full).sum().backward()
    name = f"row sp={sp}"
    db = layer.bias.grad.clone()
    if sp:  # partial per rank (the bias carries sequence_parallel): summed over TP after backward
        dist.all_reduce(db, group=tp)
    return {
        f"{name} out": _rel(_gather(out, tp, 0) if sp else out, ref),
        f"{name} dx": _rel(x.grad, ref_x.grad.chunk(2, -1)[r]),
        f"{name} dW": _rel(layer.weight.grad, ref_w.grad.chunk(2, 1)[r]),
        f"{name} db": _rel(db, ref_b.grad),
    }


def _check_moe(tp, ep, dispatcher: str) -> dict:
    """EP 2 over explicit groups (experts 0-1 on EP rank 0, 2-3 on EP rank 1; TP ranks hold
    different tokens) against the whole layer in this process on both EP ranks' tokens."""
    m = parse_config(MOE + ["--moe-token-dispatcher-type", dispatcher]).model
    layer = MoELayer(m, layer_number=0, tp_group=None, ep_group=ep, etp_group=get_process_groups().etp)
    full = MoELayer(m, layer_number=0, tp_group=None, ep_group=None, etp_group=get_process_groups().etp)
    initialize_weights(layer, seed=3, tp_group=None, etp_group=get_process_groups().etp)
    initialize_weights(full, seed=3, tp_group=None, etp_group=get_process_groups().etp)
    me, ep_rank = dist.get_rank(), dist.get_rank(ep)
    members = [me - 2 * ep_rank + 2 * k for k in range(2)]  # global ranks of my EP group, by EP rank
    xs = [_rand(S, B, H, seed=10 + g) for g in members]
    ups = [_rand(S, B, H, seed=20 + g) for g in members]
    x = xs[ep_rank].clone().requires_grad_()
    out = layer(x)
    (out * ups[ep_rank]).sum().backward()
    ref_xs = [t.clone().requires_grad_() for t in xs]
    refs = [full(t) for t in ref_xs]
    sum((ref * up).sum() for ref, up in zip(refs, ups)).backward()
    name = f"moe {dispatcher}"
    errors = {
        f"{name} experts held": float(sorted(layer.experts.local_experts) != [str(2 * ep_rank), str(2 * ep_rank + 1)]),
        f"{name} out": _rel(out, refs[ep_rank]),
        f"{name} dx": _rel(x.grad, ref_xs[ep_rank].grad),
    }
    for key, p in layer.experts.local_experts.named_parameters():
        errors[f"{name} d{key}"] = _rel(p.grad, full.experts.local_experts.get_parameter(key).grad)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=ep)  # each EP rank saw its own tokens (a data-parallel split)
    errors[f"{name} d router"] = _rel(router_grad, full.router.weight.grad)
    return errors


# --- in-place reductions ---------------------------------------------------------------------


class _Recorder:
    """Wraps ``dist.all_reduce`` (in this spawned rank only) to record the storage it reduces."""

    def __init__(self):
        self.pointers, self._original = [], dist.all_reduce

    def __enter__(self):
        def record(tensor, *args, **kwargs):
            self.pointers.append(tensor.data_ptr())
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = record
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def _check_in_place(tp) -> dict:
    r = dist.get_rank(tp)
    errors = {}
    # reduce_from(in_place): the input's storage is reduced and returned; autograd still right.
    a = _rand(S, B, H, seed=30 + r).requires_grad_()
    w = _rand(S, B, H, seed=40)
    x = a * 2.0
    with _Recorder() as rec:
        y = mappings.reduce_from_tensor_model_parallel_region(x, tp, in_place=True)
    (y * w).sum().backward()
    total = sum(_rand(S, B, H, seed=30 + k) * 2.0 for k in range(2))
    errors["reduce_from in place: reduced the input's storage"] = float(rec.pointers != [x.data_ptr()])
    errors["reduce_from in place: output is the input's storage"] = float(y.data_ptr() != x.data_ptr())
    errors["reduce_from in place fwd"] = _rel(y, total)
    errors["reduce_from in place bwd"] = _rel(a.grad, 2.0 * w)
    # Default: a copy is reduced and the input keeps its values.
    x = _rand(S, B, H, seed=30 + r)
    y = mappings.reduce_from_tensor_model_parallel_region(x, tp)
    errors["reduce_from copy keeps input"] = _rel(x, _rand(S, B, H, seed=30 + r))
    errors["reduce_from copy fwd"] = _rel(y, total / 2.0)

    # copy_to(in_place): the incoming gradient itself is all-reduced (no clone).
    x = _rand(S, B, H, seed=50).requires_grad_()
    weight = _rand(H, H, seed=60 + r)
    y = mappings.copy_to_tensor_model_parallel_region(x, tp, in_place=True)
    seen = []
    y.register_hook(lambda g: seen.append(g.data_ptr()))
    with _Recorder() as rec:
        (y @ weight).sum().backward()
    expected = sum(torch.ones(S, B, H) @ _rand(H, H, seed=60 + k).t() for k in range(2))
    errors["copy_to in place: reduced the incoming grad's storage"] = float(rec.pointers != seen or not seen)
    errors["copy_to in place bwd"] = _rel(x.grad, expected)
    # Default (clone): autograd hands the same gradient tensor to both inputs of an addition, so
    # reducing it in place would also sum the other input's gradient over TP (``other`` is made
    # first, so its backward runs after the copy's and would read the reduced tensor).
    a = _rand(S, B, H, seed=70).requires_grad_()
    b = _rand(S, B, H, seed=71).requires_grad_()
    up = _rand(S, B, H, seed=72 + r)
    other = b * 2.0
    (mappings.copy_to_tensor_model_parallel_region(a, tp) + other).mul(up).sum().backward()
    errors["copy_to default: other branch's grad untouched"] = _rel(b.grad, 2.0 * up)
    errors["copy_to default bwd"] = _rel(a.grad, sum(_rand(S, B, H, seed=72 + k) for k in range(2)))

    # RowParallelLinear reduces its own matmul output in place: one all-reduce, no other buffer.
    layer = RowParallelLinear(OUT, H, bias=False, tp_group=tp)
    with torch.no_grad():
        layer.weight.copy_(_rand(H, OUT // 2, seed=80 + r))
    products, matmul = [], torch.matmul

    def recording_matmul(*args, **kwargs):
        out = matmul(*args, **kwargs)
        products.append(out.data_ptr())
        return out

    torch.matmul = recording_matmul
    try:
        with _Recorder() as rec:
            out = layer(_rand(S, B, OUT // 2, seed=90 + r).requires_grad_())
    finally:
        torch.matmul = matmul
    errors["row linear: reduced its matmul output in place"] = float(rec.pointers != products or not products)
    errors["row linear: returned the reduced storage"] = float(out.data_ptr() != products[0])
    return errors


def _all_checks() -> dict:
    tp, ep = _groups()
    errors = {"parallel_state untouched": float(parallel_state.model_parallel_is_initialized())}
    for sp in (False, True):
        errors.update(_check_column(tp, sp))
        errors.update(_check_row(tp, sp))
    for dispatcher in ("allgather", "alltoall"):
        errors.update(_check_moe(tp, ep, dispatcher))
    errors.update(_check_in_place(tp))
    errors["parallel_state still untouched"] = float(parallel_state.model_parallel_is_initialized())
    return errors


def test_layers_on_explicit_groups_and_in_place_reductions():
    results = run_distributed(_all_checks, world_size=4, timeout=120)
    assert len(results[0]) > 40
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= 1e-6}  # NaN counts as bad
        assert not bad, f"rank {rank}: {bad}"


def test_layers_and_models_require_their_groups():
    """No default group: a layer, a model, DDP and the schedules must be given theirs (``None``: this rank alone)."""
    import pytest

    from megalm.distributed import DistributedDataParallel
    from megalm.models import GPTModel
    from megalm.pipeline_parallel import get_forward_backward_func

    with pytest.raises(TypeError, match="tp_group"):
        ColumnParallelLinear(H, OUT)
    layer = ColumnParallelLinear(H, OUT, tp_group=None)
    assert layer.tp_group is None and layer.tp_size == 1 and tuple(layer.weight.shape) == (OUT, H)
    with pytest.raises(TypeError, match="process_groups"):
        GPTModel(make_config(validate=False))
    with pytest.raises(TypeError, match="process_groups"):
        DistributedDataParallel(layer, parallel_config())
    with pytest.raises(TypeError):
        get_forward_backward_func()
    assert not hasattr(parallel_state, "CURRENT") and not hasattr(parallel_state, "resolve_group")

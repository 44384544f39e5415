"""Tensor-parallel building blocks on real spawned gloo ranks.

One 4-rank group runs every check for TP 2 and 4 (re-initializing the layout in between)
and returns the measured errors; the assertions run in the test process.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalm import parallel_state
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    checkpoint,
    copy_to_tensor_model_parallel_region,
    dropout,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    gather_tensor_parallel_grad,
    gather_tensor_parallel_param,
    get_all_rng_states,
    initialize_weights,
    model_parallel_manual_seed,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    set_all_rng_states,
    vocab_parallel_cross_entropy,
)
from megalm.tensor_parallel import linear_cross_entropy as lce
from megalm.tensor_parallel.utils import assemble_full, shard_of_full
from megalm.transformer.norm import LayerNorm
from tests.distributed_harness import run_distributed

S, B, H = 8, 2, 12  # sequence, batch, hidden (divisible by 4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def _reinit(tp: int) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _same_input(*shape, seed=0):
    """The same random tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rank_input(*shape, seed=0):
    """A different random tensor on every TP rank (deterministic from seed and tp rank)."""
    return _same_input(*shape, seed=seed + 1000 * (1 + parallel_state.get_tensor_model_parallel_rank()))


def _all_tp(fn, *shape, seed=0):
    """``fn`` of every TP rank's :func:`_rank_input`, stacked (what the collectives should see)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return torch.stack([fn(_same_input(*shape, seed=seed + 1000 * (1 + r))) for r in range(tp)])


# --- mappings -----------------------------------------------------------------------------


def _check_mappings(tp: int) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    g = parallel_state.get_process_groups().tp
    errors = {}
    every_w = _all_tp(lambda t: t, S, B, H, seed=1)  # [tp, S, B, H] per-rank upstream grads
    w = every_w[r]

    x = _same_input(S, B, H).requires_grad_()
    y = copy_to_tensor_model_parallel_region(x, g)
    (y * w).sum().backward()
    errors["copy fwd"] = _rel(y, x)
    errors["copy bwd"] = _rel(x.grad, every_w.sum(0))

    x = _rank_input(S, B, H).requires_grad_()
    y = reduce_from_tensor_model_parallel_region(x, g)
    (y * w).sum().backward()
    errors["reduce fwd"] = _rel(y, _all_tp(lambda t: t, S, B, H).sum(0))
    errors["reduce bwd"] = _rel(x.grad, w)

    x = _same_input(S, B, H).requires_grad_()
    y = scatter_to_tensor_model_parallel_region(x, g)
    (y * w.chunk(tp, -1)[r]).sum().backward()
    errors["scatter fwd"] = _rel(y, x.chunk(tp, -1)[r])
    errors["scatter bwd"] = _rel(x.grad, torch.cat([every_w[k].chunk(tp, -1)[k] for k in range(tp)], -1))

    x = _rank_input(S, B, H // tp).requires_grad_()
    y = gather_from_tensor_model_parallel_region(x, g)
    (y * w).sum().backward()
    errors["gather fwd"] = _rel(y, torch.cat(list(_all_tp(lambda t: t, S, B, H // tp)), -1))
    errors["gather bwd"] = _rel(x.grad, w.chunk(tp, -1)[r])

    x = _same_input(S, B, H).requires_grad_()
    y = scatter_to_sequence_parallel_region(x, g)
    (y * w.chunk(tp, 0)[r]).sum().backward()
    errors["seq scatter fwd"] = _rel(y, x.chunk(tp, 0)[r])
    errors["seq scatter bwd"] = _rel(x.grad, torch.cat([every_w[k].chunk(tp, 0)[k] for k in range(tp)], 0))

    for tp_grad in (True, False):
        x = _rank_input(S // tp, B, H).requires_grad_()
        y = gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=tp_grad)
        (y * (w if tp_grad else every_w[0])).sum().backward()
        errors[f"seq gather fwd {tp_grad}"] = _rel(y, torch.cat(list(_all_tp(lambda t: t, S // tp, B, H)), 0))
        expected = every_w.sum(0).chunk(tp, 0)[r] if tp_grad else every_w[0].chunk(tp, 0)[r]
        errors[f"seq gather bwd {tp_grad}"] = _rel(x.grad, expected)

    x = _rank_input(S, B, H).requires_grad_()
    y = reduce_scatter_to_sequence_parallel_region(x, g)
    (y * w.chunk(tp, 0)[r]).sum().backward()
    errors["seq reduce-scatter fwd"] = _rel(y, _all_tp(lambda t: t, S, B, H).sum(0).chunk(tp, 0)[r])
    errors["seq reduce-scatter bwd"] = _rel(x.grad, torch.cat([every_w[k].chunk(tp, 0)[k] for k in range(tp)], 0))
    return errors


# --- layers -------------------------------------------------------------------------------


def _grad_errors(prefix, layer, reference_grads) -> dict:
    return {
        f"{prefix} grad {name}": _rel(
            gather_tensor_parallel_grad(p, group=get_process_groups().tp), reference_grads[name]
        )
        for name, p in layer.named_parameters()
    }


def _reference(layer, fn, x, upstream):
    """Run ``fn(x, full_params)`` in plain PyTorch on the gathered weights; return (out, x grad, param grads)."""
    full = {
        n: gather_tensor_parallel_param(p, group=get_process_groups().tp).requires_grad_()
        for n, p in layer.named_parameters()
    }
    x = x.detach().clone().requires_grad_(x.dtype.is_floating_point)
    out = fn(x, full)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in full.items()}


def _check_column_linear(tp: int, sp: bool, gather_output: bool, stride: int) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    out_features = 16
    layer = ColumnParallelLinear(
        H,
        out_features,
        bias=True,
        gather_output=gather_output,
        stride=stride,
        sequence_parallel=sp,
        init_std=0.3,
        tp_group=get_process_groups().tp,
    )
    initialize_weights(
        layer, seed=9, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp
    )  # parameters start as torch.empty: never compare uninitialized memory
    with torch.no_grad():
        layer.bias.normal_(generator=torch.Generator().manual_seed(r))
    x_full = _same_input(S, B, H, seed=2)
    x = (x_full.chunk(tp, 0)[r] if sp else x_full).clone().requires_grad_()
    out = layer(x)
    upstream_full = _same_input(S, B, out_features, seed=3)
    local_cols = shard_of_full(upstream_full, -1, r, tp, stride)
    upstream = upstream_full if gather_output else local_cols
    (out * upstream).sum().backward()
    ref_out, ref_dx, ref_grads = _reference(
        layer, lambda t, p: F.linear(t, p["weight"], p["bias"]), x_full, upstream_full
    )
    name = f"column sp={sp} gather={gather_output} stride={stride}"
    full_out = out if gather_output else assemble_full([_gather_list(out)[k] for k in range(tp)], -1, stride)
    dx = x.grad if not sp else torch.cat(_gather_list(x.grad), 0)
    errors = {f"{name} out": _rel(full_out, ref_out), f"{name} dx": _rel(dx, ref_dx)}
    errors.update(_grad_errors(name, layer, ref_grads))
    return errors


def _gather_list(t: torch.Tensor):
    parts = [torch.empty_like(t) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return parts


def _check_row_linear(tp: int, sp: bool, input_is_parallel: bool) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    in_features = 16
    layer = RowParallelLinear(
        in_features,
        H,
        bias=True,
        input_is_parallel=input_is_parallel,
        sequence_parallel=sp,
        init_std=0.3,
        tp_group=get_process_groups().tp,
    )
    initialize_weights(layer, seed=10, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    with torch.no_grad():
        layer.bias.normal_(generator=torch.Generator().manual_seed(7))
    x_full = _same_input(S, B, in_features, seed=4)
    x = (x_full.chunk(tp, -1)[r] if input_is_parallel else x_full).clone().requires_grad_()
    out = layer(x)
    upstream_full = _same_input(S, B, H, seed=5)
    (out * (upstream_full.chunk(tp, 0)[r] if sp else upstream_full)).sum().backward()
    allreduce_sequence_parallel_grads(layer, tp_group=get_process_groups().tp)
    ref_out, ref_dx, ref_grads = _reference(
        layer, lambda t, p: F.linear(t, p["weight"], p["bias"]), x_full, upstream_full
    )
    name = f"row sp={sp} parallel_input={input_is_parallel}"
    full_out = torch.cat(_gather_list(out), 0) if sp else out
    dx = torch.cat(_gather_list(x.grad), -1) if input_is_parallel else x.grad
    errors = {f"{name} out": _rel(full_out, ref_out), f"{name} dx": _rel(dx, ref_dx)}
    errors.update(_grad_errors(name, layer, ref_grads))
    return errors


def _check_embedding(tp: int, reduce_scatter: bool) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    vocab, unpadded = 32, 27
    layer = VocabParallelEmbedding(
        vocab,
        H,
        init_std=0.5,
        vocab_unpadded=unpadded,
        reduce_scatter_to_sequence=reduce_scatter,
        tp_group=get_process_groups().tp,
    )
    initialize_weights(layer, seed=11, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    tokens = torch.randint(0, unpadded, (B, S), generator=torch.Generator().manual_seed(6))
    out = layer(tokens)
    upstream_full = _same_input(B, S, H, seed=8)
    local_upstream = upstream_full.transpose(0, 1).chunk(tp, 0)[r] if reduce_scatter else upstream_full
    (out * local_upstream).sum().backward()
    ref_out, _, ref_grads = _reference(layer, lambda t, p: F.embedding(t, p["weight"]), tokens, upstream_full)
    full_out = torch.cat(_gather_list(out), 0).transpose(0, 1) if reduce_scatter else out
    full_weight = gather_tensor_parallel_param(layer.weight, group=get_process_groups().tp)
    name = f"embedding reduce_scatter={reduce_scatter}"
    errors = {
        f"{name} out": _rel(full_out, ref_out),
        f"{name} padded rows nonzero": full_weight[unpadded:].abs().sum().item(),
    }
    errors.update(_grad_errors(name, layer, ref_grads))
    return errors


# --- cross entropy ------------------------------------------------------------------------


def _check_cross_entropy(tp: int, dtype: torch.dtype) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    vocab = 40
    logits_full = (_same_input(S, B, vocab, seed=9) * 3).to(dtype)
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(10))
    shard = logits_full.chunk(tp, -1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, tp_group=get_process_groups().tp)
    weights = _same_input(S, B, seed=12)
    (loss * weights).sum().backward()
    ref_logits = logits_full.float().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none").view(S, B)
    (ref_loss * weights).sum().backward()
    name = f"cross entropy {dtype}"
    grad_error = _rel(shard.grad.float(), ref_logits.grad.chunk(tp, -1)[r])
    if dtype == torch.bfloat16:  # the logits gradient is returned in bf16 (8 mantissa bits)
        grad_error = float(grad_error > 8e-3)
    return {
        f"{name} loss": _rel(loss, ref_loss),
        f"{name} grad": grad_error,
        f"{name} loss dtype is fp32": float(loss.dtype != torch.float32),
        f"{name} grad dtype": float(shard.grad.dtype != dtype),
    }


def _check_linear_cross_entropy(tp: int, sp: bool) -> dict:
    """Fused output layer + loss on vocabulary shards (padding on the last rank) against
    ``F.linear`` + ``F.cross_entropy`` on the full weight: the loss's own gradient (saved
    gradients scaled) and an arbitrary one (recomputed), chunks of 5 tokens."""
    r = parallel_state.get_tensor_model_parallel_rank()
    vocab_padded, vocab = 16 * tp, 16 * tp - 3
    budget, minimum = lce.CHUNK_BYTES["cpu"], lce.MIN_CHUNK_ROWS
    lce.CHUNK_BYTES["cpu"], lce.MIN_CHUNK_ROWS = 4 * 5 * (vocab_padded // tp), 1
    x_full = _same_input(S, B, H, seed=20)
    weight_full = _same_input(vocab_padded, H, seed=21)
    weight_full[vocab:] = 0.0
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(22))
    mask = (_same_input(S, B, seed=23) > -0.5).float()
    errors = {}
    for kind, upstream in (("scaled", 0.25 * mask), ("recomputed", _same_input(S, B, seed=24))):
        x = (x_full.chunk(tp, 0)[r] if sp else x_full).clone().requires_grad_()
        weight = weight_full.chunk(tp, 0)[r].clone().requires_grad_()
        loss = lce.linear_cross_entropy(
            x, weight, target, vocab, token_weight=mask, sequence_parallel=sp, tp_group=get_process_groups().tp
        )
        (loss * upstream).sum().backward()
        ref_x, ref_w = x_full.clone().requires_grad_(), weight_full.clone().requires_grad_()
        logits = (ref_x @ ref_w.t()).masked_fill(torch.arange(vocab_padded) >= vocab, float("-inf"))
        ref_loss = F.cross_entropy(logits.view(-1, vocab_padded), target.view(-1), reduction="none").view(S, B)
        (ref_loss * upstream).sum().backward()
        dx = torch.cat(_gather_list(x.grad), 0) if sp else x.grad
        name = f"linear cross entropy sp={sp} {kind}"
        errors[f"{name} loss"] = _rel(loss, ref_loss)
        errors[f"{name} dx"] = _rel(dx, ref_x.grad)
        errors[f"{name} dW"] = _rel(torch.cat(_gather_list(weight.grad), 0), ref_w.grad)
    lce.CHUNK_BYTES["cpu"], lce.MIN_CHUNK_ROWS = budget, minimum
    return errors


# --- sequence-parallel norm grads ---------------------------------------------------------


def _check_sequence_parallel_norm(tp: int) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    norm = LayerNorm(H, sequence_parallel=True)
    initialize_weights(norm, seed=3, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    x_full = _same_input(S, B, H, seed=13)
    upstream = _same_input(S, B, H, seed=14)
    (norm(x_full.chunk(tp, 0)[r]) * upstream.chunk(tp, 0)[r]).sum().backward()
    allreduce_sequence_parallel_grads(norm, tp_group=get_process_groups().tp)
    ref = LayerNorm(H)
    initialize_weights(ref, seed=3, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    (ref(x_full) * upstream).sum().backward()
    return {
        "sp norm weight grad": _rel(norm.weight.grad, ref.weight.grad),
        "sp norm bias grad": _rel(norm.bias.grad, ref.bias.grad),
    }


# --- RNG streams and recompute ------------------------------------------------------------


def _check_rng(tp: int) -> dict:
    r = parallel_state.get_tensor_model_parallel_rank()
    tracker = model_parallel_manual_seed(123, get_process_groups())
    default_draw = torch.rand(6)
    with tracker.fork():
        tracker_draw = torch.rand(6)
        with tracker.fork():  # re-entrant: continues the same stream
            nested_draw = torch.rand(6)
    after_fork = torch.rand(6)
    expected_tracker = torch.rand(12, generator=torch.Generator().manual_seed(123 + 2718 + r))
    expected_default = torch.rand(12, generator=torch.Generator().manual_seed(123))
    every_default = _gather_list(default_draw)
    every_tracker = _gather_list(tracker_draw)
    errors = {
        "default stream = seed": _rel(torch.cat([default_draw, after_fork]), expected_default),
        "tracker stream = seed+2718+tp_rank": _rel(torch.cat([tracker_draw, nested_draw]), expected_tracker),
        "default identical over TP": max(_rel(d, every_default[0]) for d in every_default),
        "tracker differs over TP": float(any(torch.equal(every_tracker[0], t) for t in every_tracker[1:])),
    }
    saved = get_all_rng_states(tracker)
    first = (torch.rand(3), _fork_rand(tracker, 3))
    set_all_rng_states(saved, tracker)
    again = (torch.rand(3), _fork_rand(tracker, 3))
    errors["rng state round trip"] = _rel(torch.cat(first), torch.cat(again))
    errors.update(_check_checkpoint())
    return errors


def _fork_rand(tracker, n):
    with tracker.fork():
        return torch.rand(n)


def _dropout_function(tracker):
    def run(x, w):
        y = dropout(torch.tanh(x * w), 0.5, True, tracker)  # default stream
        return dropout(y * w, 0.3, True, tracker, model_parallel_rng=True)  # model-parallel stream

    return run


def _run_dropout_function(use_checkpoint: bool, inside_fork: bool):
    tracker = model_parallel_manual_seed(77, get_process_groups())
    x = _same_input(S, B, H, seed=15).requires_grad_()
    w = _same_input(H, seed=16).requires_grad_()
    run = _dropout_function(tracker)
    fn = (lambda a, b: checkpoint(run, a, b, rng_tracker=tracker)) if use_checkpoint else run
    if inside_fork:
        with tracker.fork():
            out = fn(x, w)
    else:
        out = fn(x, w)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, w.grad, torch.rand(4), _fork_rand(tracker, 4)


def _check_checkpoint() -> dict:
    errors = {}
    for inside_fork in (False, True):
        plain = _run_dropout_function(False, inside_fork)
        recomputed = _run_dropout_function(True, inside_fork)
        names = ("out", "x grad", "w grad", "default stream after", "tracker stream after")
        for name, a, b in zip(names, plain, recomputed):
            errors[f"checkpoint fork={inside_fork} {name} not bit-identical"] = float(not torch.equal(a, b))
    return errors


# --- the spawned check ----------------------------------------------------------------------


def _all_checks() -> dict:
    errors = {}
    for tp in (2, 4):
        _reinit(tp)
        torch.manual_seed(0)
        found = {}
        found.update(_check_mappings(tp))
        for sp in (False, True):
            for gather_output, stride in ((False, 1), (True, 1), (False, 2)):
                found.update(_check_column_linear(tp, sp, gather_output, stride))
            found.update(_check_row_linear(tp, sp, True))
        found.update(_check_row_linear(tp, False, False))
        for reduce_scatter in (False, True):
            found.update(_check_embedding(tp, reduce_scatter))
        for dtype in (torch.float32, torch.bfloat16):
            found.update(_check_cross_entropy(tp, dtype))
        for sp in (False, True):
            found.update(_check_linear_cross_entropy(tp, sp))
        found.update(_check_sequence_parallel_norm(tp))
        found.update(_check_rng(tp))
        errors.update({f"tp{tp} {k}": v for k, v in found.items()})
    return errors


def test_tensor_parallel_blocks_match_single_device_reference():
    results = run_distributed(_all_checks, world_size=4, timeout=150)
    assert len(results[0]) > 100
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}  # NaN counts as bad
        assert not bad, f"rank {rank}: {bad}"


def test_single_rank_cross_entropy_and_shard_helpers():
    logits = torch.randn(5, 3, 17, requires_grad=True)
    target = torch.randint(0, 17, (5, 3))
    loss = vocab_parallel_cross_entropy(logits, target, tp_group=get_process_groups().tp)
    loss.sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 17), target.view(-1), reduction="none").view(5, 3)
    ref.sum().backward()
    assert _rel(loss, ref) < 1e-6 and _rel(logits.grad, ref_logits.grad) < 1e-6
    full = torch.arange(24.0).view(8, 3)
    shards = [shard_of_full(full, 0, r, 2, stride=2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 3, 12, 15]  # [gate_0; up_0]
    assert torch.equal(assemble_full(shards, 0, stride=2), full)

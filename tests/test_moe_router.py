"""MoE router, capacity and auxiliary losses against references written here (one process).

References loop over tokens and experts in plain Python/torch so they share no code with
megalm.transformer.moe.
"""

import math

import pytest
import torch

from megalm.parallel_state import get_process_groups
from megalm.transformer.moe.capacity import apply_capacity, expert_capacity
from megalm.transformer.moe.router import TopKRouter, topk_routing
from tests.configs import model_config

E, H = 6, 8


# The router's model section: E experts, top-2, auxiliary and z losses on.
ROUTER = dict(num_layers=2, hidden_size=H, num_attention_heads=2, num_experts=E, moe_router_topk=2)
ROUTER.update(moe_ffn_hidden_size=16, ffn_hidden_size=32, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)


def _reference_topk(logits, k, score, pre_softmax):
    """Per token: pick the k best experts, weight them (loops over tokens)."""
    probs = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        row = logits[t].tolist()
        if score == "softmax" and pre_softmax:
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            p = [v / sum(ex) for v in ex]
            chosen = sorted(range(E), key=lambda i: -p[i])[:k]
            for i in chosen:
                probs[t, i] = p[i]
        elif score == "softmax":
            chosen = sorted(range(E), key=lambda i: -row[i])[:k]
            m = max(row[i] for i in chosen)
            z = sum(math.exp(row[i] - m) for i in chosen)
            for i in chosen:
                probs[t, i] = math.exp(row[i] - m) / z
        else:
            sig = [1 / (1 + math.exp(-v)) for v in row]
            chosen = sorted(range(E), key=lambda i: -sig[i])[:k]
            total = sum(sig[i] for i in chosen) if k > 1 else 1.0
            for i in chosen:
                probs[t, i] = sig[i] / total
    return probs


@pytest.mark.parametrize(
    "score, pre, k",
    [
        ("softmax", False, 2),
        ("softmax", True, 2),
        ("sigmoid", False, 2),
        ("softmax", True, 1),
        ("sigmoid", False, 1),
        ("softmax", False, 3),
    ],
)
def test_topk_selection_and_probabilities(score, pre, k):
    logits = torch.randn(40, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    probs, routing_map = topk_routing(logits, k, score, pre)
    ref = _reference_topk(logits, k, score, pre)
    assert torch.equal(routing_map, ref != 0)
    assert routing_map.sum(1).eq(k).all()
    torch.testing.assert_close(probs, ref, rtol=1e-12, atol=1e-12)


def _router_and_input(seed=0, s=5, b=3, **kw):
    torch.manual_seed(seed)
    router = TopKRouter(model_config(ROUTER, kw), layer_number=4, tp_group=get_process_groups().tp)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    hidden = torch.randn(s, b, H, requires_grad=True)
    return router, hidden


def _reference_losses(logits, k, s, b):
    """Switch load balancing, sequence load balancing and z-loss from their formulas."""
    T = logits.shape[0]
    p = torch.softmax(logits, -1)
    top = torch.topk(logits, k, dim=-1).indices
    counts = torch.zeros(E)
    seq_counts = torch.zeros(b, E)
    for t in range(T):
        for i in top[t].tolist():
            counts[i] += 1
            seq_counts[t % b, i] += 1  # token t = s_index * b + b_index
    f = counts / (T * k)
    P = p.mean(0)
    switch = E * (f * P).sum()
    seq = 0.0
    for j in range(b):
        rows = p[j::b]
        seq = seq + E * ((seq_counts[j] / (s * k)) * rows.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    return switch, seq / b, z, counts


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_aux_and_z_loss_values_and_tokens_per_expert(kind):
    router, hidden = _router_and_input(moe_router_load_balancing_type=kind, moe_per_layer_logging=True)
    router.train()
    router(hidden)
    logged = router.moe_state.pop_metrics()
    logits = hidden.detach().reshape(-1, H) @ router.weight.detach().t()
    switch, seq, z, counts = _reference_losses(logits, 2, 5, 3)
    assert logged["load_balancing_loss"].item() == pytest.approx(
        (switch if kind == "aux_loss" else seq).item(), rel=1e-5
    )
    assert logged["load_balancing_loss_layer_4"].item() == pytest.approx(logged["load_balancing_loss"].item())
    assert logged["z_loss"].item() == pytest.approx(z.item(), rel=1e-5)
    assert [logged[f"tokens_per_expert_layer_4_expert_{i}"].item() for i in range(E)] == counts.tolist()
    assert logged["expert_load_imbalance"].item() == pytest.approx((counts.max() / counts.mean()).item())
    assert router.moe_state.pop_metrics() == {}  # popped


@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_aux_gradients_enter_backward_with_the_main_loss_scale(scale):
    """d/dW of (main + scale * (aux_coeff * aux + z_coeff * z)), scale = loss scale / micro-batches."""
    router, hidden = _router_and_input(seed=1)
    router.train()
    weights = torch.randn(15, E, generator=torch.Generator().manual_seed(9))
    router.moe_state.set_aux_loss_scale(scale)
    probs, _ = router(hidden)
    (probs * weights).sum().backward()
    got_w, got_x = router.weight.grad.clone(), hidden.grad.clone()

    w = router.weight.detach().clone().requires_grad_()
    x = hidden.detach().clone().requires_grad_()
    logits = x.reshape(-1, H) @ w.t()
    top = torch.topk(logits, 2, dim=-1)
    probs = torch.zeros_like(logits).scatter(1, top.indices, torch.softmax(top.values, -1))
    switch, _, z, _ = _reference_losses(logits, 2, 5, 3)
    ((probs * weights).sum() + scale * (0.1 * switch + 0.01 * z)).backward()
    torch.testing.assert_close(got_w, w.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-5, atol=1e-7)


def test_no_aux_losses_in_evaluation():
    router, hidden = _router_and_input()
    router.eval()
    probs, _ = router(hidden)
    probs.sum().backward()
    assert router.moe_state.pop_metrics() == {}
    # Gradient of sum(probs) through the top-k softmax only: zero (each row sums to 1).
    assert router.weight.grad.abs().max() < 1e-6


# --- capacity -------------------------------------------------------------------------------------


def _reference_keep(probs, routing_map, capacity, policy, pad):
    """Per expert, the token set kept (and the fillers with padding), by sorting in Python."""
    T = probs.shape[0]
    keep = torch.zeros_like(routing_map)
    for e in range(probs.shape[1]):
        routed = [t for t in range(T) if routing_map[t, e]]
        if policy == "probs":
            routed.sort(key=lambda t: (-probs[t, e].item(), t))
        kept = routed[:capacity]
        if pad:
            kept += [t for t in range(T) if not routing_map[t, e]][: max(0, capacity - len(kept))]
        keep[kept, e] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_drops_exactly_the_expected_tokens(policy, pad):
    logits = torch.randn(20, E, generator=torch.Generator().manual_seed(5))
    logits[:, 0] += 2.0  # expert 0 is over-full
    probs, routing_map = topk_routing(logits, 2)
    capacity = expert_capacity(20, E, 2, 1.0)
    assert capacity == 7  # ceil(20 * 2 / 6)
    assert routing_map[:, 0].sum() > capacity
    new_probs, new_map = apply_capacity(probs, routing_map, capacity, policy, pad)
    expected = _reference_keep(probs, routing_map, capacity, policy, pad)
    assert torch.equal(new_map, expected)
    kept = routing_map & expected
    torch.testing.assert_close(new_probs, probs * kept)
    if pad:
        assert new_map.sum(0).eq(capacity).all()
    else:
        assert new_map.sum(0).le(capacity).all() and torch.equal(new_map, kept)
    if policy == "position":  # the first `capacity` routed tokens survive
        first = routing_map[:, 0].nonzero().flatten()[:capacity]
        assert torch.equal(kept[:, 0].nonzero().flatten(), first)


def test_router_applies_capacity():
    router, hidden = _router_and_input(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    router.eval()
    probs, routing_map = router(hidden)
    capacity = math.ceil(15 * 2 / E * 0.5)
    assert routing_map.sum(0).le(capacity).all() and routing_map.sum() < 30
    assert torch.equal(probs != 0, routing_map)


# --- Megatron's routing recipes: group-limited top-k, scaling factor, aux-loss-free expert bias ---


def _reference_recipe(logits, k, score, groups=None, group_topk=None, scale=None, bias=None):
    """Per token, in plain Python: sigmoid/softmax scores; a group's score is the sum of its
    k // group_topk best (biased) scores; the k best (biased) experts of the best groups; weights
    are the unbiased scores (sigmoid: normalized; softmax: softmax over the chosen logits) x scale."""
    probs = torch.zeros_like(logits)
    per_group = E // groups if groups else E
    for t in range(logits.shape[0]):
        row = logits[t].tolist()
        scores = [1 / (1 + math.exp(-v)) for v in row] if score == "sigmoid" else row
        choice = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
        allowed = list(range(E))
        if groups:
            group_score = [
                sum(sorted(choice[g * per_group : (g + 1) * per_group], reverse=True)[: k // group_topk])
                for g in range(groups)
            ]
            best = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
            allowed = [i for i in range(E) if i // per_group in best]
        chosen = sorted(allowed, key=lambda i: -choice[i])[:k]
        if score == "sigmoid":
            total = sum(scores[i] for i in chosen) if k > 1 else 1.0
            weights = {i: scores[i] / total for i in chosen}
        else:
            m = max(row[i] for i in chosen)
            z = sum(math.exp(row[i] - m) for i in chosen)
            weights = {i: math.exp(row[i] - m) / z for i in chosen}
        for i, w in weights.items():
            probs[t, i] = w * (scale or 1.0)
    return probs


@pytest.mark.parametrize(
    "score, groups, group_topk, k, scale, biased",
    [
        ("sigmoid", 3, 1, 2, None, False),
        ("sigmoid", 3, 2, 2, 2.5, True),
        ("softmax", 2, 1, 2, None, False),
        ("softmax", None, None, 3, 1.5, False),
        ("sigmoid", None, None, 2, None, True),
    ],
)
def test_routing_recipes_equal_a_per_token_reference(score, groups, group_topk, k, scale, biased):
    torch.manual_seed(7)
    logits = torch.randn(40, E, dtype=torch.float64)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.5, -0.4, 0.1], dtype=torch.float64) if biased else None
    probs, routing_map = topk_routing(
        logits, k, score, num_groups=groups, group_topk=group_topk, scaling_factor=scale, expert_bias=bias
    )
    expected = _reference_recipe(logits, k, score, groups, group_topk, scale, bias.tolist() if biased else None)
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(routing_map, expected != 0)
    if biased:  # the bias changed which experts are chosen, not only their weights
        assert not torch.equal(routing_map, topk_routing(logits, k, score, num_groups=groups, group_topk=group_topk)[1])


def test_expert_bias_moves_towards_even_load_and_counts_restart():
    m = model_config(ROUTER, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    m.moe_router_bias_update_rate = 0.01
    router = TopKRouter(m, layer_number=1, tp_group=get_process_groups().tp)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(10, 3, H)
    router(x)
    router(x)  # two microbatches accumulate
    counts = router.local_tokens_per_expert.clone()
    assert counts.sum().item() == 2 * 30 * 2  # tokens x topk, twice
    router.update_expert_bias(counts)
    mean = counts.mean()
    expected = torch.where(counts < mean, 0.01, torch.where(counts > mean, -0.01, 0.0))
    torch.testing.assert_close(router.expert_bias, expected)
    assert router.local_tokens_per_expert.sum().item() == 0
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()
    router.eval()
    with torch.no_grad():
        router(x)  # evaluation does not count
    assert router.local_tokens_per_expert.sum().item() == 0


def test_routing_recipe_flags_are_checked():
    from megalm.config import ConfigError
    from megalm.config.validation import _validate_moe_routing_recipes

    cases = [
        (dict(moe_router_num_groups=3), "go together"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=1), "not divisible by --moe-router-num-groups 4"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=4), r"must be in \[1, 3\]"),
        (dict(moe_router_num_groups=6, moe_router_group_topk=1), "must be between --moe-router-group-topk 1"),
        (dict(moe_router_enable_expert_bias=True), "needs --moe-router-score-function sigmoid"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            _validate_moe_routing_recipes(model_config(ROUTER, overrides))

"""MoE layer in one process: experts (looped = grouped), the layer against a per-token
reference, recomputation, model wiring, flags and FLOPs accounting."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megalm.config import ConfigError, build_parser, config_from_args, parse_config, validate_config
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel.initialization import initialize_weights
from megalm.tensor_parallel.param_info import param_info
from megalm.tensor_parallel.utils import shard_of_full
from megalm.transformer.moe import MoELayer, is_moe_layer, moe_layer_pattern
from megalm.transformer.moe.experts import ExpertMLP, LocalExperts

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "8",
    "--vocab-size",
    "64",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "24",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]


def _experts(m, grouped):
    experts = LocalExperts(m, first=0, count=4, grouped=grouped)
    initialize_weights(experts, seed=5, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    return experts


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_and_looped_experts_are_equal(swiglu):
    m = parse_config([*BASE, *(["--swiglu"] if swiglu else [])]).model
    loop, grouped = _experts(m, False), _experts(m, True)
    counts = [5, 0, 9, 2]  # an expert without tokens too
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    outs = []
    for experts in (loop, grouped):
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        out.backward(grad)
        outs.append((out.detach(), xi.grad, {n: p.grad for n, p in experts.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-7)
    assert outs[0][2].keys() == outs[1][2].keys()
    for name in outs[0][2]:
        torch.testing.assert_close(outs[0][2][name], outs[1][2][name], rtol=1e-6, atol=1e-7)
    assert outs[0][2]["local_experts.1.linear_fc1.weight"].abs().max() == 0  # no tokens, zero grad


@pytest.mark.parametrize("grouped", [False, True])
def test_zero3_gathers_the_local_experts_as_one_unit(grouped):
    """ZeRO-3 (DP 1, in process) over the experts: their buckets are freed after the build and after each
    backward; only ``LocalExperts`` is hooked (the grouped GEMM reads its experts' weights without running
    their modules), its pre-hook gathers every bucket of them; output, input and weight gradients equal the
    plain experts' bit for bit."""
    from megalm.config import ParallelConfig
    from megalm.distributed import DistributedDataParallel

    m = parse_config([*BASE, "--swiglu"]).model
    plain = _experts(m, grouped)
    zero3 = DistributedDataParallel(
        _experts(m, grouped),  # the same initial values (seeded by name)
        ParallelConfig(data_parallel_sharding_strategy="optim_grads_params", ddp_bucket_size=600),
        process_groups=get_process_groups(),
    )
    buckets = [b for buf in zero3.expert_buffers for b in buf.buckets]
    assert len(buckets) > 1 and not zero3.buffers  # several expert buckets, no dense parameter
    hooked = [mod for mod in zero3.module.modules() if mod._forward_pre_hooks]
    assert hooked == [zero3.module]  # LocalExperts alone, not its ExpertMLPs or their linears
    counts = [5, 0, 9, 2]  # an expert without tokens too
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
    for step in range(2):
        assert not any(b.gathered for b in buckets)
        assert all(p.untyped_storage().nbytes() == 0 for p in zero3.module.parameters()), step
        zero3.zero_grad_buffer()
        outs = []
        for experts in (plain, zero3):
            xi = x.clone().requires_grad_()
            out = experts(xi, counts)
            out.backward(grad)
            outs.append((out.detach(), xi.grad))
        zero3.finish_grad_sync()
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        assert not any(b.gathered for b in buckets)  # freed once every gradient of the bucket was in
        for (name, p), q in zip(plain.named_parameters(), zero3.module.parameters()):
            torch.testing.assert_close(zero3.sharded_grad_views([q])[0], p.grad.flatten(), rtol=0, atol=0)
            p.grad = None


@pytest.mark.parametrize("swiglu, bias", [(False, True), (True, False), (True, True)])
def test_expert_tensor_parallel_shards_sum_to_the_whole_expert(swiglu, bias):
    """ETP 2: fc1 column- ([gate_r; up_r] with SwiGLU, its bias split alike) and fc2 row-parallel shards cut
    from the whole expert, fc2's bias whole on both; the two partial outputs sum to the whole expert's output,
    the input gradients too, each shard's gradient is the matching cut of the whole expert's, and fc2's bias
    gets the whole gradient on both ranks."""
    m = parse_config([*BASE, *(["--swiglu"] if swiglu else []), *([] if bias else ["--disable-bias-linear"])]).model
    whole = ExpertMLP(m)
    initialize_weights(whole, seed=5, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    with torch.no_grad():  # biases start at 0: make them count
        for p in whole.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    shards = [ExpertMLP(m, etp=2) for _ in range(2)]
    for rank, shard in enumerate(shards):
        for (name, p), full in zip(shard.named_parameters(), whole.parameters()):
            info = param_info(p)
            assert info.expert and not info.sequence_parallel, name
            if name == "linear_fc2.bias":
                assert not info.tensor_parallel
                cut = full
            else:
                assert info.tensor_parallel and info.partition_stride == (2 if swiglu and "fc1" in name else 1)
                assert info.partition_dim == (0 if "fc1" in name else 1)
                cut = shard_of_full(full, info.partition_dim, rank, 2, info.partition_stride)
            with torch.no_grad():
                p.copy_(cut)
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(7, 16, generator=torch.Generator().manual_seed(4))
    xs = [x.clone().requires_grad_() for _ in range(3)]
    for xi, expert in zip(xs, [whole, *shards]):
        expert(xi).backward(grad)
    torch.testing.assert_close(shards[0](x) + shards[1](x), whole(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs[1].grad + xs[2].grad, xs[0].grad, rtol=1e-5, atol=1e-6)
    for rank, shard in enumerate(shards):
        for (name, p), full in zip(shard.named_parameters(), whole.parameters()):
            info = param_info(p)
            cut = (
                full.grad
                if name == "linear_fc2.bias"
                else shard_of_full(full.grad, info.partition_dim, rank, 2, info.partition_stride)
            )
            torch.testing.assert_close(p.grad, cut, rtol=1e-5, atol=1e-6)


def test_experts_without_any_token():
    """An EP rank may receive no token at all: both paths return [0, h] and zero gradients."""
    m = parse_config(BASE).model
    for grouped in (False, True):
        experts = _experts(m, grouped)
        x = torch.zeros(0, 16, requires_grad=True)
        out = experts(x, [0, 0, 0, 0])
        assert out.shape == (0, 16)
        out.sum().backward()
        assert all(p.grad is not None and p.grad.abs().max() == 0 for p in experts.parameters())


def _reference_moe(layer, x, squared_relu=False):
    """out[t] = sum over the token's top-2 experts of p * fc2(act(fc1(x_t))), token by token; act is GELU, or
    relu(y)^2 with --squared-relu."""
    act = (lambda y: F.relu(y) ** 2) if squared_relu else F.gelu
    w = layer.router.weight
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ w.t() + (0 if layer.router.bias is None else layer.router.bias)  # Megatron: biased
        top = torch.topk(logits, 2)
        p = torch.softmax(top.values, -1)
        for weight, e in zip(p, top.indices.tolist()):
            expert = layer.experts.local_experts[str(e)]
            hid = act(expert.linear_fc1(x[t]))
            out[t] += weight * expert.linear_fc2(hid)
    return out


@pytest.mark.parametrize(
    "dispatcher, grouped, squared_relu",
    [("allgather", False, False), ("allgather", True, False), ("alltoall", False, False), ("alltoall", True, False)]
    + [("alltoall", True, True)],  # the experts' dynamic-shape bias + squared ReLU
)
def test_moe_layer_equals_per_token_reference(dispatcher, grouped, squared_relu):
    extra = ["--moe-token-dispatcher-type", dispatcher, "--moe-router-load-balancing-type", "none"]
    extra += ["--squared-relu"] if squared_relu else []
    m = parse_config([*BASE, *extra, *(["--moe-grouped-gemm"] if grouped else [])]).model
    layer = MoELayer(
        m,
        layer_number=0,
        tp_group=get_process_groups().tp,
        ep_group=get_process_groups().ep,
        etp_group=get_process_groups().etp,
    )
    initialize_weights(layer, seed=3, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp)
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
    out = layer(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = _reference_moe(layer, ref_x.reshape(-1, 16), squared_relu).view(6, 2, 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-6)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)


def test_parameter_names_attributes_and_shared_experts():
    m = parse_config([*BASE, "--moe-shared-expert-intermediate-size", "8", "--swiglu", "--disable-bias-linear"]).model
    layer = MoELayer(
        m,
        layer_number=2,
        tp_group=get_process_groups().tp,
        ep_group=get_process_groups().ep,
        etp_group=get_process_groups().etp,
    )
    params = dict(layer.named_parameters())
    assert sorted(params) == sorted(
        ["router.weight", "shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"]
        + [f"experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)]
    )
    assert params["experts.local_experts.3.linear_fc1.weight"].shape == (48, 16)  # [gate; up]
    assert params["shared_experts.linear_fc1.weight"].shape == (16, 16)
    for name, p in params.items():
        assert (getattr(p, "allreduce", True) is False) == name.startswith("experts.")
        assert p.tensor_model_parallel is False or name.startswith("shared_experts")


def test_full_recompute_gives_same_gradients_and_logs_once():
    from megalm.models import GPTModel
    from megalm.tensor_parallel.random import model_parallel_manual_seed

    grads, logged = [], []
    for recompute in (
        [],
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    ):
        cfg = parse_config(
            [*BASE, "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01", "--moe-layer-freq", "2", *recompute]
        )
        tracker = model_parallel_manual_seed(1, get_process_groups())
        model = GPTModel(cfg, process_groups=get_process_groups(), rng_tracker=tracker)
        model.train()
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model(tokens, labels=tokens).mean().backward()
        logged.append(model.moe_metrics())
        assert model.moe_metrics() == {}  # the recomputation in backward recorded nothing
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert logged[0].keys() == logged[1].keys() == {"load_balancing_loss", "z_loss", "expert_load_imbalance"}
    for key in logged[0]:
        assert logged[0][key].item() == pytest.approx(logged[1][key].item(), rel=1e-6)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7)
    assert grads[0]["decoder.layers.2.mlp.router.weight"].abs().sum() > 0


def test_layer_pattern():
    assert moe_layer_pattern(parse_config(BASE).model) == [True] * 4
    assert moe_layer_pattern(parse_config([*BASE, "--moe-layer-freq", "2"]).model) == [True, False, True, False]
    assert moe_layer_pattern(parse_config([*BASE, "--moe-layer-freq", "[0,1,1,1]"]).model) == [False, True, True, True]
    assert moe_layer_pattern(parse_config([*BASE, "--moe-layer-freq", "([0]+[1]*1)*2"]).model) == [
        False,
        True,
        False,
        True,
    ]
    dense = dataclasses.replace(parse_config(BASE).model, num_experts=None)
    assert not any(is_moe_layer(dense, i) for i in range(4))


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            ["--expert-model-parallel-size", "2", "--num-experts", "3"],
            2,
            "--num-experts 3 is not divisible by --expert-model-parallel-size 2",
        ),
        (["--moe-router-topk", "5"], None, "--moe-router-topk 5 must be in"),
        (["--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
        (["--moe-layer-freq", "[1,0]"], None, "one 0/1 entry per layer"),
        (["--moe-layer-freq", "[1,2,1,1]"], None, "one 0/1 entry per layer"),
        (["--moe-pad-expert-input-to-capacity"], None, "needs --moe-expert-capacity-factor"),
        (["--moe-expert-capacity-factor", "0"], None, "must be positive"),
        (  # --moe-router-pre-softmax is ignored with sigmoid scores (as Megatron); expert bias needs sigmoid
            ["--moe-router-enable-expert-bias"],
            None,
            "needs --moe-router-score-function sigmoid",
        ),
        (
            ["--moe-shared-expert-intermediate-size", "5", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            2,
            "divisible by --tensor-model-parallel-size 2",
        ),
        (["--expert-model-parallel-size", "4"], 2, "must divide data"),
        (["--expert-tensor-parallel-size", "5"], None, "must divide the experts' hidden size"),
        (
            ["--expert-tensor-parallel-size", "2", "--disable-bias-linear", "--optimizer", "lamb"],
            None,
            "not supported with --optimizer lamb",
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--disable-bias-linear", "--expert-model-parallel-size", "2"],
            2,
            "expert_tensor_parallel_size 2 x expert_model_parallel_size 2 = 4 must divide",
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--disable-bias-linear", "--local-sgd-interval", "2"],
            None,
            "not supported with --local-sgd-interval",
        ),
        (
            ["--expert-tensor-parallel-size", "2", "--disable-bias-linear"]
            + ["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads"],
            2,
            "optim_grads with --expert-tensor-parallel-size 2 is not built yet",
        ),
    ],
)
def test_invalid_moe_flags(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_config([*BASE, *argv], world_size=world)


def test_expert_parallel_needs_experts_and_bad_freq_is_rejected(capsys):
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2 needs --num-experts"):
        validate_config(config_from_args(build_parser().parse_args(["--expert-model-parallel-size", "2"])), 2)
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + ["--moe-layer-freq", "every other"])
    assert "--moe-layer-freq 'every other' is neither an int nor a list" in str(e.value)


def test_defaults_follow_megatron():
    m = parse_config([*BASE, "--ffn-hidden-size", "40"]).model
    assert (m.moe_router_topk, m.moe_token_dispatcher_type, m.moe_router_load_balancing_type) == (
        2,
        "allgather",
        "aux_loss",
    )
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_expert_capacity_factor) == (0.0, None, None)
    assert m.moe_ffn_hidden_size == 24
    m = validate_config(
        config_from_args(
            build_parser().parse_args(["--num-experts", "2", "--ffn-hidden-size", "40", "--hidden-size", "16"])
        )
    ).model
    assert m.moe_ffn_hidden_size == 40  # default: --ffn-hidden-size


def test_flops_count_only_activated_experts():
    from megalm.flops import num_floating_point_operations

    base = [
        "--moe-layer-freq",
        "[1,0,1,0]",
        "--moe-router-topk",
        "2",
        "--moe-shared-expert-intermediate-size",
        "8",
        "--ffn-hidden-size",
        "40",
    ]
    moe = parse_config([*BASE, *base])
    dense = dataclasses.replace(moe.model, num_experts=None)
    h, s, B = 16, 8, 3
    delta = num_floating_point_operations(moe, B) - num_floating_point_operations(dense, B)
    # Two MoE layers replace a 40-wide MLP (2 matmuls of h x 40, x 3 for fwd + 2 bwd, x 2 FLOPs per MAC)
    # by 2 activated experts of width 24 plus the shared expert of width 8; router FLOPs not counted.
    per_width = 2 * 2 * 3 * B * s * h
    assert delta == pytest.approx(2 * per_width * (2 * 24 + 8 - 40))
    more_experts = dataclasses.replace(moe.model, num_experts=64)
    assert num_floating_point_operations(more_experts, B) == num_floating_point_operations(moe, B)


def test_chunks_of_one_rank_share_one_moe_state():
    """Virtual pipeline stages: the loss function runs on the last chunk and must report the MoE
    layers of every chunk, as one model would (share_moe_state, called by build_model_chunks)."""
    from megalm.models import GPTModel
    from megalm.tensor_parallel.random import model_parallel_manual_seed
    from megalm.transformer.moe import pop_moe_metrics, share_moe_state
    from megalm.transformer.moe.moe_layer import moe_states

    cfg = parse_config([*BASE, "--moe-aux-loss-coeff", "0.1"])
    groups, tracker = get_process_groups(), model_parallel_manual_seed(1, get_process_groups())
    first = GPTModel(cfg, True, False, layer_numbers=[0, 1], process_groups=groups, rng_tracker=tracker)
    last = GPTModel(cfg, False, True, layer_numbers=[2, 3], process_groups=groups, rng_tracker=tracker)
    whole = GPTModel(cfg, process_groups=groups, rng_tracker=tracker)  # the same four MoE layers in one model
    for model in (first, last, whole):
        initialize_weights(
            model, seed=3, tp_group=get_process_groups().tp, etp_group=get_process_groups().etp
        )  # by global parameter name: the chunks are the whole model's layers
    assert len(moe_states([first, last])) == 2
    share_moe_state([first, last])
    assert moe_states([first, last]) == [first.moe_state] and last.moe_state is first.moe_state
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    hidden = first(tokens)
    last.set_input_tensor(hidden)
    last(tokens, labels=tokens)
    metrics = pop_moe_metrics(last)  # what pretrain_gpt.loss_func reports, on the last chunk
    whole(tokens, labels=tokens)
    expected = pop_moe_metrics(whole)
    assert metrics.keys() == expected.keys() == {"load_balancing_loss", "expert_load_imbalance"}
    for key in expected:
        assert metrics[key].item() == pytest.approx(expected[key].item(), rel=1e-5), key

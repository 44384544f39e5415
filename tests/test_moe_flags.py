"""DeepSeek-V3 script's MoE flags and --recompute-modules, in one process.

* ``--moe-token-dispatcher-type flex`` builds the alltoall dispatcher (Megatron's fused DeepEP /
  HybridEP kernels are CUDA-only; the exchange and results are alltoall's);
* ``--moe-router-force-load-balancing`` routes by random logits whatever the router's weights (two
  routers with different weights choose the same experts), with the router's gradient passed through;
* ``--moe-shared-expert-gate`` scales the shared expert by ``sigmoid(x . g)``;
* ``--moe-permute-fusion`` is accepted with the no-effect warning;
* every ``--recompute-modules`` entry (core_attn, mlp, moe, moe_act, layernorm, shared_experts,
  mla_up_proj) gives the gradients of no recomputation; an unknown entry is refused.
"""

import pytest
import torch

from megalm.config import ConfigError, build_parser, config_from_args, validate_config
from megalm.fusions import EAGER
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel.initialization import initialize_weights
from megalm.transformer.moe.moe_layer import MoELayer
from megalm.transformer.moe.token_dispatcher import AlltoAllTokenDispatcher
from tests.configs import MLA_MOE, make_config
from tests.logs import megalm_logs

VOCAB = 64


# Dense, then two MoE layers with a shared expert (the tests add the flag they check).
MODEL = dict(MLA_MOE, num_layers=3, seq_length=8, moe_layer_freq=[0, 1, 1], moe_aux_loss_coeff=1e-2)
MODEL.update(moe_shared_expert_intermediate_size=16, vocab_size=VOCAB)


def _grads(cfg, tokens):
    torch.manual_seed(0)
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups()).train()
    model(tokens, labels=tokens).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_every_recompute_module_keeps_the_gradients():
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = _grads(make_config(MODEL), tokens)
    modules = ["core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts", "mla_up_proj"]
    for chosen in [modules, ["mla_up_proj", "moe_act", "layernorm", "shared_experts"]]:
        got = _grads(make_config(MODEL, recompute_granularity="selective", recompute_modules=chosen), tokens)
        assert set(got) == set(ref)
        for name, g in ref.items():
            assert torch.allclose(got[name], g, rtol=0, atol=1e-6), (chosen, name)
    with pytest.raises(ConfigError, match="--recompute-modules mlp_act is not a recomputable module"):
        make_config(MODEL, recompute_granularity="selective", recompute_modules=["mlp", "mlp_act"])


def test_flex_dispatcher_is_alltoall_and_permute_fusion_has_no_effect(capsys):
    cfg = make_config(MODEL, moe_token_dispatcher_type="flex")
    layer = next(
        m
        for m in GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups()).modules()
        if isinstance(m, MoELayer)
    )
    assert isinstance(layer.token_dispatcher, AlltoAllTokenDispatcher)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--moe-permute-fusion"]
    with megalm_logs("stderr"):  # megalm's own handler (caplog misses it once a run set propagate off)
        validate_config(config_from_args(build_parser().parse_args(argv)))
    assert "--moe-permute-fusion (megalm permutes tokens" in capsys.readouterr().err


def test_force_load_balancing_routes_at_random_with_straight_through_gradient():
    cfg = make_config(MODEL, moe_router_force_load_balancing=True)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(2))
    routes = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        layer = MoELayer(cfg.model, 1, tp_group=None, ep_group=None, etp_group=None).train()
        initialize_weights(layer, seed, tp_group=None, etp_group=None)
        torch.manual_seed(5)  # the random logits' draw
        probs, routing_map = layer.router(x)
        routes.append(routing_map)
        probs.sum().backward()
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert torch.equal(routes[0], routes[1])  # different router weights, same random routing
    torch.manual_seed(5)
    plain = MoELayer(make_config(MODEL).model, 1, tp_group=None, ep_group=None, etp_group=None).train()
    initialize_weights(plain, 0, tp_group=None, etp_group=None)
    assert not torch.equal(plain.router(x)[1], routes[0])


def test_shared_expert_gate():
    cfg = make_config(MODEL, moe_shared_expert_gate=True)
    torch.manual_seed(0)
    layer = MoELayer(cfg.model, 1, tp_group=None, ep_group=None, etp_group=None).eval()
    initialize_weights(layer, 0, tp_group=None, etp_group=None)
    with torch.no_grad():
        layer.shared_experts.gate_weight.normal_(0, 0.5)
    names = [n for n, _ in layer.named_parameters()]
    assert "shared_experts.gate_weight" in names  # Megatron's name
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        routed = layer._routed_experts(x.reshape(16, 32), probs, routing_map).view(8, 2, 32)
        gate = torch.sigmoid(x @ layer.shared_experts.gate_weight.t())
        shared = layer.shared_experts(x)
        assert torch.allclose(layer(x), routed + shared * gate, atol=1e-6)
        assert not torch.allclose(layer(x), routed + shared, atol=1e-3)

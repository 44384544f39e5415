"""--cpu-offloading / --cpu-offloading-num-layers: the saved activations of the first N layers go to
host memory after their forward and come back, prefetched one layer ahead, before their backward
(CPU -> CPU copies here, the code path of a GPU; megalm/transformer/activation_offload.py).

* a 3-layer GPT (GPT: LayerNorm, GELU, dropout, fp32; Llama: RMSNorm, SwiGLU, RoPE, GQA, bf16; Llama
  with 4 experts top-2 in every layer, fp32, EP 1), 2 layers offloaded: loss and every gradient
  bit-identical to no offloading;
* bytes moved each way = the distinct storages those layers save, measured on the plain model
  layer by layer (parameters and storages every layer saves excluded: RoPE tables, the document mask),
  and (GPT fp32; Llama fp32 with a document mask) exactly the planner's per-layer formula
  (megalm/estimate/activations.py): the shared tables and mask are not copied per layer;
* the planner's kept activations with 1 and 2 layers offloaded equal the saved bytes left on the
  device (measured by an outer hook, which the offloaded layers' own hooks shadow);
* order: both layers' D2H copies in forward; in backward layer 1 comes back before layer 2's
  backward, layer 0 before layer 1's (one layer ahead), each before its tensors are unpacked;
* two microbatches forwarded before either backward (gradient accumulation, 1F1B-like order) keep
  their own copies: the accumulated gradients equal the plain model's; evaluation moves nothing;
* the combinations that are not built are refused with the flag named.
Training runs (DP 2, TP 2 x DP 2) are in tests/test_sharding_strategy_training.py.
"""

import copy

import pytest
import torch

from megalm.config import ConfigError, validate_config
from megalm.estimate.activations import Shape, layer_bytes
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel import model_parallel_manual_seed
from tests.configs import make_config
from tests.test_estimate import LLAMA, MODEL

GPT = dict(hidden_dropout=0.1, attention_dropout=0.1)
MOE = dict(num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2, **LLAMA)
CASES = {"gpt-fp32": (GPT, torch.float32), "llama-bf16": (LLAMA, torch.bfloat16), "moe-fp32": (MOE, torch.float32)}


def _model(model_kw, dtype, offload_layers=0):
    cfg = copy.deepcopy(make_config(MODEL, model_kw, num_layers=3))  # editable: the validated config is frozen
    cfg.model.cpu_offloading, cfg.model.cpu_offloading_num_layers = offload_layers > 0, offload_layers
    validate_config(cfg, world_size=1)
    torch.manual_seed(0)
    return cfg, GPTModel(cfg, process_groups=get_process_groups()).to(dtype).train()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 200, (2, 32), generator=g) for _ in range(2)]


def _document_mask():
    """A ``[2, 1, 32, 32]`` document-causal mask (documents of 10 and 22 tokens, then 32)."""
    from megalm.transformer.attention_mask import document_causal_mask

    return document_causal_mask(torch.tensor([[0] * 10 + [1] * 22, [0] * 32]))


def _losses_and_grads(model, seeds, order, attention_mask=None):
    """Forward every microbatch of ``seeds``, then backward them in ``order`` (indices)."""
    losses = []
    for seed in seeds:
        model_parallel_manual_seed(7 + seed, get_process_groups(), model.rng_tracker)
        tokens, labels = _batch(seed)
        losses.append(model(tokens, None, labels, attention_mask=attention_mask).sum())
    for i in order:
        losses[i].backward()
    return [x.detach() for x in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved_bytes_per_layer(model, seed=0, attention_mask=None):
    """Distinct storages each layer saves for backward in one forward (parameters excluded, and storages
    that several layers save: every saved storage stays alive until backward, so one address seen in two
    layers is one tensor, an input every layer gets)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, current, alive = {}, [None], []  # alive: a storage freed mid-forward must not lend its address
    hooks = []
    for layer in model.decoder.layers.values():
        hooks.append(layer.register_forward_pre_hook(lambda m, a: current.__setitem__(0, m.layer_number)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(x):
        s = x.untyped_storage()
        if current[0] is not None and s.data_ptr() not in params:
            seen.setdefault(current[0], {})[s.data_ptr()] = s.nbytes()
            alive.append(s)
        return x

    model_parallel_manual_seed(7 + seed, get_process_groups(), model.rng_tracker)
    tokens, labels = _batch(seed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(tokens, None, labels, attention_mask=attention_mask)
    for h in hooks:
        h.remove()
    shared = {key for layer in seen.values() for key in layer if sum(key in other for other in seen.values()) > 1}
    return {k: sum(n for key, n in v.items() if key not in shared) for k, v in seen.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_layers_change_nothing_and_move_their_saved_bytes(case):
    model_kw, dtype = CASES[case]
    _, plain = _model(model_kw, dtype)
    ref_loss, ref_grads = _losses_and_grads(plain, [0], [0])
    per_layer = _saved_bytes_per_layer(plain)

    _, model = _model(model_kw, dtype, offload_layers=2)
    transfer = model.decoder.activation_offload.transfer
    transfer.trace = []
    loss, grads = _losses_and_grads(model, [0], [0])
    assert torch.equal(loss[0], ref_loss[0])
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    assert transfer.bytes_d2h == transfer.bytes_h2d == per_layer[0] + per_layer[1] > 0
    assert sum(n for d, tag, n in transfer.trace if d == "d2h" and tag == 0) == per_layer[0]

    # the order of events: (direction, layer) with consecutive repeats collapsed
    order = [(d, tag) for d, tag, _ in transfer.trace]
    order = [e for i, e in enumerate(order) if i == 0 or e != order[i - 1]]
    assert order == [("d2h", 0), ("d2h", 1), ("h2d", 1), ("h2d", 0), ("unpack", 1), ("unpack", 0)]


@pytest.mark.parametrize("model_kw, mask", [({}, False), (LLAMA, False), (LLAMA, True)], ids=["gpt", "llama", "mask"])
def test_offloaded_bytes_match_the_activation_formula(model_kw, mask):
    """fp32 RoPE tables and the document mask, saved by every layer, stay on the device (a copy per layer
    moved them N times): the bytes moved are the per-layer formula's, which counts the tables once per
    model; results unchanged.  With the mask SDPA also saves a float copy of it per layer, which the
    formula leaves out: there the bytes are the layers' own saved storages, measured."""
    attention_mask = _document_mask() if mask else None
    _, plain = _model(model_kw, torch.float32)
    ref_loss, ref_grads = _losses_and_grads(plain, [0], [0], attention_mask)
    cfg, model = _model(model_kw, torch.float32, offload_layers=2)
    transfer = model.decoder.activation_offload.transfer
    loss, grads = _losses_and_grads(model, [0], [0], attention_mask)
    assert torch.equal(loss[0], ref_loss[0]) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    sh = Shape(cfg.model.seq_length, cfg.training.micro_batch_size, 1, False, 4, device="cpu")
    formula = 2 * sum(layer_bytes(cfg.model, sh).values())
    measured = _saved_bytes_per_layer(plain, attention_mask=attention_mask)
    assert transfer.bytes_d2h == transfer.bytes_h2d == (measured[0] + measured[1] if mask else formula)
    if mask:  # SDPA's fp32 [2, 1, 32, 32] additive mask, made from the boolean one in each layer
        assert transfer.bytes_d2h == formula + 2 * 4 * 2 * 32 * 32


def test_microbatches_in_flight_keep_their_own_copies_and_eval_moves_nothing():
    _, plain = _model(GPT, torch.float32)
    ref_losses, ref_grads = _losses_and_grads(plain, [0, 1], [0, 1])
    _, model = _model(GPT, torch.float32, offload_layers=2)
    losses, grads = _losses_and_grads(model, [0, 1], [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    transfer = model.decoder.activation_offload.transfer
    moved = transfer.bytes_d2h
    tokens, labels = _batch(2)
    with torch.no_grad():
        model(tokens, None, labels)
    model.eval()
    model(tokens, None, labels).sum().backward()
    assert transfer.bytes_d2h == moved and transfer.bytes_h2d == moved


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(cpu_offloading_num_layers=3), "--cpu-offloading-num-layers must be in [1, --num-layers - 1]"),
        (dict(cpu_offloading_num_layers=0), "--cpu-offloading-num-layers must be in [1, --num-layers - 1]"),
        (dict(cpu_offloading_weights=True), "--cpu-offloading-weights is not built"),
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            "--cpu-offloading with --recompute-granularity is not supported",
        ),
        (dict(pipeline_model_parallel_size=3), "--cpu-offloading with --pipeline-model-parallel-size > 1"),
        (dict(context_parallel_size=2), "--cpu-offloading with --context-parallel-size > 1"),
        (dict(num_experts=4, expert_model_parallel_size=2), "--cpu-offloading with --expert-model-parallel-size > 1"),
        (
            dict(data_parallel_sharding_strategy="optim_grads_params"),
            "--cpu-offloading with --data-parallel-sharding-strategy optim_grads_params",
        ),
        (dict(cpu_offloading=False, cpu_offloading_num_layers=1), "--cpu-offloading-num-layers needs --cpu-offloading"),
        (dict(overlap_cpu_optimizer_d2h_h2d=True), "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload"),
    ],
)
def test_unsupported_combinations_are_refused(settings, message):
    cfg = copy.deepcopy(make_config(MODEL, num_layers=3))  # editable: the validated config is frozen
    cfg.model.cpu_offloading, cfg.model.cpu_offloading_num_layers = True, 1
    for key, value in settings.items():
        section = next(s for s in (cfg.model, cfg.parallel, cfg.training) if hasattr(s, key))
        setattr(section, key, value)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert message in str(err.value)


def test_planner_keeps_what_the_device_keeps():
    """The saved tensors left on the device (those outside the offloaded layers: an outer hook sees only
    them, the offloaded layers' own hooks take over inside) against the planner's kept activations."""
    from tests.test_estimate import predicted_activation_bytes, saved_activation_bytes

    for layers in (1, 2):
        cfg, model = _model({}, torch.float32, offload_layers=layers)
        measured = saved_activation_bytes(model, cfg, torch.float32)
        predicted = predicted_activation_bytes(cfg)
        assert predicted == measured
    assert measured < predicted_activation_bytes(_model({}, torch.float32)[0]) / 2

"""GPT model: TP/SP parity with a single-device model, layout-independent init, recompute,
pipeline-style chunks and the layer split.

The multi-rank checks run in one 4-rank spawned group; each rank first builds the TP=1
reference of every configuration (no model-parallel state: tensor-parallel size one),
then every TP layout, and returns the measured errors for the assertions here.
"""

import copy

import pytest
import torch

from megalm import parallel_state
from megalm.config import validate_config
from megalm.models import GPTModel, layers_for_stage
from megalm.parallel_state import get_process_groups
from megalm.tensor_parallel import (
    allreduce_sequence_parallel_grads,
    gather_tensor_parallel_grad,
    gather_tensor_parallel_param,
    model_parallel_manual_seed,
)
from tests.configs import SMALL_GPT, make_config
from tests.distributed_harness import run_distributed

VOCAB, SEQ, BATCH = 50, 8, 2

CONFIGS = {
    "learned-LayerNorm-GELU-bias-tied-MHA": dict(position_embedding_type="learned_absolute"),
    "rope-RMSNorm-SwiGLU-nobias-untied-GQA": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
    ),
    "rope-RMSNorm-SwiGLU-nobias-untied-GQA-blocked-attention": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
        attention_backend="blocked",
    ),
    "rope50%-LayerNorm-SwiGLU-bias-tied-MHA": dict(position_embedding_type="rope", rotary_percent=0.5, swiglu=True),
    "learned-RMSNorm-GELU-nobias-untied-GQA": dict(
        normalization="RMSNorm",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
    ),
    "none-LayerNorm-GELU-bias-untied-MHA": dict(
        position_embedding_type="none", untie_embeddings_and_output_weights=True
    ),
    "learned-LayerNorm-SquaredReLU-bias-tied-MHA": dict(squared_relu=True),  # Megatron's --squared-relu
    # Megatron recipe flags: per-head q/k norms (partial TP gradients), a QKV-only bias, 1 + w norms.
    "rope-qk-layernorm-qkv-bias-1p-GQA": dict(
        position_embedding_type="rope",
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=True,
        apply_layernorm_1p=True,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
    ),
}


# The model of these tests (2 layers, hidden 32, no dropout); the tests add a CONFIGS variant and TP/SP.
MODEL = dict(SMALL_GPT, seq_length=SEQ, vocab_size=VOCAB, seed=4321)


def make_batch(seed: int = 0, rope_offsets: bool = False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    if rope_offsets:
        positions = positions + 3 * torch.arange(BATCH).unsqueeze(1)
    loss_weights = torch.rand(BATCH, SEQ, generator=g)
    return tokens, positions, labels, loss_weights


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def _run_step(model, batch):
    tokens, positions, labels, weights = batch
    loss = model(tokens, positions, labels)
    (loss * weights).sum().backward()
    allreduce_sequence_parallel_grads(model, tp_group=get_process_groups().tp)
    return loss.detach()


def _snapshot(model, batch):
    """Loss, logits and the full (gathered) weights and grads of one training step."""
    with torch.no_grad():
        logits = gather_tensor_parallel_param(_vocab_split(model(batch[0], batch[1])), group=get_process_groups().tp)
    padding = logits[..., VOCAB:]
    assert bool(torch.all(padding == float("-inf"))), "padded vocabulary logits must be -inf"
    logits = logits[..., :VOCAB]
    loss = _run_step(model, batch)
    weights = {n: gather_tensor_parallel_param(p, group=get_process_groups().tp) for n, p in model.named_parameters()}
    grads = {n: gather_tensor_parallel_grad(p, group=get_process_groups().tp) for n, p in model.named_parameters()}
    return {"loss": loss, "logits": logits, "weights": weights, "grads": grads}


def _vocab_split(logits):
    logits.tensor_model_parallel, logits.partition_dim, logits.partition_stride = True, 2, 1
    return logits


def _attribute_problems(model, sp: bool, tp: int = 1) -> list:
    problems = []
    for name, p in model.named_parameters():
        if not all(hasattr(p, a) for a in ("tensor_model_parallel", "partition_dim", "partition_stride")):
            problems.append(f"{name}: missing TP attributes")
        is_norm_or_bias = "layernorm" in name or name.endswith(".bias")
        if (p.ndim == 1) != is_norm_or_bias:
            problems.append(f"{name}: ndim {p.ndim}")
        wants_sp = sp and (
            "layernorm" in name
            or (name.endswith(".bias") and "linear_proj" in name)
            or (name.endswith(".bias") and "linear_fc2" in name)
        )
        # q/k norms act on each rank's heads: partial gradients under any TP, summed like SP norms'
        wants_sp = wants_sp or (tp > 1 and ("q_layernorm" in name or "k_layernorm" in name))
        if bool(getattr(p, "sequence_parallel", False)) != wants_sp:
            problems.append(f"{name}: sequence_parallel={getattr(p, 'sequence_parallel', None)}")
        if ("word_embeddings" in name or name == "output_layer.weight") and getattr(p, "vocab_unpadded", None) != VOCAB:
            problems.append(f"{name}: vocab_unpadded={getattr(p, 'vocab_unpadded', None)}")
    return problems


# --- parity over TP / SP layouts ------------------------------------------------------------


def _parity_errors(name, overrides, tp, sp, reference, batch) -> dict:
    model = GPTModel(
        make_config(MODEL, overrides, tensor_model_parallel_size=tp, sequence_parallel=sp),
        process_groups=get_process_groups(),
    )
    got = _snapshot(model, batch)
    tag = f"{name} tp={tp} sp={sp}"
    errors = {
        f"{tag} weights differ": float(
            any(not torch.equal(got["weights"][n], w) for n, w in reference["weights"].items())
        ),
        f"{tag} names differ": float(set(got["weights"]) != set(reference["weights"])),
        f"{tag} loss": _rel(got["loss"], reference["loss"]),
        f"{tag} logits": _rel(got["logits"], reference["logits"]),
        f"{tag} attribute problems": float(len(_attribute_problems(model, sp and tp > 1, tp))),
    }
    for n, g in reference["grads"].items():
        errors[f"{tag} grad {n}"] = _rel(got["grads"][n], g)
    return errors


def _check_parity() -> dict:
    batches = {name: make_batch(i, rope_offsets="rope" in name) for i, name in enumerate(CONFIGS)}
    parallel_state.destroy_model_parallel()
    references = {
        name: _snapshot(GPTModel(make_config(MODEL, o), process_groups=get_process_groups()), batches[name])
        for name, o in CONFIGS.items()
    }
    errors = {}
    for tp in (1, 2, 4):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        for name, overrides in CONFIGS.items():
            for sp in (False, True) if tp > 1 else (False,):
                errors.update(_parity_errors(name, overrides, tp, sp, references[name], batches[name]))
    return errors


# --- recompute ------------------------------------------------------------------------------

RECOMPUTE_MODES = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}


def _dropout_step(tp, sp, recompute: dict, seed=99):
    overrides = dict(
        CONFIGS["rope-RMSNorm-SwiGLU-nobias-untied-GQA"],
        hidden_dropout=0.2,
        attention_dropout=0.3,
        num_layers=3,
        **recompute,
    )
    model = GPTModel(
        make_config(MODEL, overrides, tensor_model_parallel_size=tp, sequence_parallel=sp),
        process_groups=get_process_groups(),
    )
    model.train()
    model_parallel_manual_seed(seed, get_process_groups(), model.rng_tracker)
    loss = _run_step(model, make_batch(5, rope_offsets=True))
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _recompute_mismatches(tp: int, sp: bool) -> dict:
    base_loss, base_grads = _dropout_step(tp, sp, {})
    errors = {
        f"tp={tp} sp={sp} dropout changes the loss": float(torch.equal(base_loss, _dropout_step(tp, sp, {}, 5)[0]))
    }
    for mode, settings in RECOMPUTE_MODES.items():
        loss, grads = _dropout_step(tp, sp, settings)
        tag = f"recompute {mode} tp={tp} sp={sp}"
        errors[f"{tag} loss not bit-identical"] = float(not torch.equal(loss, base_loss))
        errors[f"{tag} grads not bit-identical"] = float(
            any(not torch.equal(grads[n], g) for n, g in base_grads.items())
        )
    return errors


# --- pipeline-style chunks --------------------------------------------------------------------


def _pipeline_chunks(cfg, pp: int, vpp: int):
    split_cfg = copy.deepcopy(cfg)
    split_cfg.parallel.pipeline_model_parallel_size = pp
    split_cfg.parallel.num_virtual_stages_per_pipeline_rank = vpp
    split_cfg = validate_config(split_cfg)
    order = [(v, r) for v in range(vpp) for r in range(pp)]  # model chunk k = v * pp + r
    return [
        GPTModel(
            cfg,
            pre_process=k == 0,
            post_process=k == len(order) - 1,
            layer_numbers=layers_for_stage(split_cfg, r, v),
            process_groups=get_process_groups(),
        )
        for k, (v, r) in enumerate(order)
    ]


def _pipeline_errors(name, overrides, tp, sp) -> dict:
    cfg = make_config(MODEL, overrides, num_layers=4, tensor_model_parallel_size=tp, sequence_parallel=sp)
    batch = make_batch(3, rope_offsets="rope" in name)
    full = GPTModel(cfg, process_groups=get_process_groups())
    full_loss = _run_step(full, batch)
    full_params = dict(full.named_parameters())
    chunks = _pipeline_chunks(cfg, pp=2, vpp=2)
    tag = f"pipeline {name} tp={tp} sp={sp}"
    errors = {}
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            source = full_params["embedding.word_embeddings.weight" if getattr(p, "init_name", None) else n]
            errors[f"{tag} init {n}"] = float(not torch.equal(p, source))
    hidden = None
    tokens, positions, labels, weights = batch
    for chunk in chunks:
        if not chunk.pre_process:
            chunk.set_input_tensor(hidden)
        hidden = chunk(tokens if chunk.pre_process else None, positions, labels if chunk.post_process else None)
    (hidden * weights).sum().backward()
    errors[f"{tag} loss"] = _rel(hidden.detach(), full_loss)
    grads = {}
    for chunk in chunks:
        allreduce_sequence_parallel_grads(chunk, tp_group=get_process_groups().tp)
        for n, p in chunk.named_parameters():
            key = "embedding.word_embeddings.weight" if getattr(p, "init_name", None) else n
            grads[key] = grads[key] + p.grad if key in grads else p.grad.clone()
    covered = set(grads) == set(full_params)
    errors[f"{tag} parameters covered"] = float(not covered)
    for n, p in full_params.items():
        errors[f"{tag} grad {n}"] = _rel(grads[n], p.grad) if n in grads else 1.0
    return errors


def _check_recompute_pipeline_bf16() -> dict:
    errors = {}
    parallel_state.destroy_model_parallel()
    errors.update(_recompute_mismatches(1, False))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for sp in (False, True):
        errors.update(_recompute_mismatches(2, sp))
    for name in ("learned-LayerNorm-GELU-bias-tied-MHA", "rope-RMSNorm-SwiGLU-nobias-untied-GQA"):
        errors.update(_pipeline_errors(name, CONFIGS[name], 2, True))
    errors.update(_bf16_errors())
    return errors


def _bf16_errors() -> dict:
    cfg = make_config(
        MODEL, CONFIGS["rope-RMSNorm-SwiGLU-nobias-untied-GQA"], tensor_model_parallel_size=2, sequence_parallel=True
    )
    batch = make_batch(7, rope_offsets=True)
    fp32_loss = GPTModel(cfg, process_groups=get_process_groups())(*batch[:3]).detach()
    model = GPTModel(cfg, process_groups=get_process_groups()).to(torch.bfloat16)
    loss = _run_step(model, batch)
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
    autocast_model = GPTModel(cfg, process_groups=get_process_groups())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_loss = _run_step(autocast_model, batch)
    autocast_ok = all(
        p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in autocast_model.parameters()
    )
    return {
        "autocast loss close to fp32 (>2e-2 rel)": float(_rel(autocast_loss, fp32_loss) > 2e-2),
        "autocast grads fp32 and finite": float(not autocast_ok),
        "bf16 loss dtype": float(loss.dtype != torch.float32),
        "bf16 loss close to fp32 (>2e-2 rel)": float(_rel(loss, fp32_loss) > 2e-2),
        "bf16 grads finite": float(not finite),
        "bf16 grads bf16": float(any(p.grad.dtype != torch.bfloat16 for p in model.parameters())),
    }


# --- tests ------------------------------------------------------------------------------------


def _assert_small(results, tolerance=1e-5, minimum_checks=10):
    for rank, errors in enumerate(results):
        assert len(errors) >= minimum_checks
        bad = {k: v for k, v in errors.items() if not v <= tolerance}
        assert not bad, f"rank {rank}: {len(bad)} of {len(errors)} checks failed: {dict(list(bad.items())[:20])}"


def test_tensor_parallel_gpt_matches_single_device():
    results = run_distributed(_check_parity, world_size=4, timeout=180)
    _assert_small(results, minimum_checks=5 * 5 * 20)


def test_recompute_pipeline_chunks_and_bf16_on_tensor_parallel_ranks():
    results = run_distributed(_check_recompute_pipeline_bf16, world_size=2, timeout=180)
    _assert_small(results, minimum_checks=50)


def test_model_structure_and_tied_weights_single_rank():
    cfg = make_config(MODEL, CONFIGS["learned-LayerNorm-GELU-bias-tied-MHA"])
    model = GPTModel(cfg, process_groups=get_process_groups())
    assert model.output_layer.weight is None  # the output layer uses the embedding Parameter
    weight = model.shared_embedding_or_output_weight()
    assert weight is model.embedding.word_embeddings.weight and weight.shared_embedding
    assert weight.shape == (64, 32) and weight.vocab_unpadded == VOCAB
    assert torch.count_nonzero(weight[VOCAB:]) == 0 and torch.count_nonzero(weight[:VOCAB]) == VOCAB * 32
    assert not _attribute_problems(model, sp=False)
    names = [n for n, _ in model.named_parameters()]
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names
    assert "decoder.final_layernorm.weight" in names and "embedding.position_embeddings.weight" in names
    std = model.decoder.layers["0"].mlp.linear_fc2.weight.std().item()
    assert abs(std - 0.02 / 2) < 0.003  # scaled init: 0.02 / sqrt(2 * 2 layers)
    tokens, positions, labels, _ = make_batch(0)
    logits = model(tokens, positions)
    assert logits.shape == (BATCH, SEQ, 64)
    loss = model(tokens, positions, labels)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), reduction="none")
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32
    assert _rel(loss.reshape(-1), ref) < 1e-6

    middle = GPTModel(
        cfg, pre_process=False, post_process=False, layer_numbers=[1], process_groups=get_process_groups()
    )
    assert [n.split(".")[2] for n, _ in middle.named_parameters()] == ["1"] * len(list(middle.parameters()))
    hidden = torch.randn(SEQ, BATCH, 32)
    middle.set_input_tensor([hidden])
    assert middle(None, positions).shape == (SEQ, BATCH, 32)
    last = GPTModel(cfg, pre_process=False, post_process=True, layer_numbers=[1], process_groups=get_process_groups())
    assert last.output_layer.weight.shared_embedding and torch.equal(last.output_layer.weight, weight)


@pytest.mark.parametrize(
    "layout, expected",
    [
        (dict(num_layers=8, pp=4), {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4, 5], (3, 0): [6, 7]}),
        (
            dict(num_layers=10, pp=4, first=1, last=3),
            {(0, 0): [0], (1, 0): [1, 2, 3], (2, 0): [4, 5, 6], (3, 0): [7, 8, 9]},
        ),
        (dict(num_layers=7, pp=3, first=1), {(0, 0): [0], (1, 0): [1, 2, 3], (2, 0): [4, 5, 6]}),
        (dict(num_layers=5, pp=3, last=1), {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4]}),
        (
            dict(num_layers=8, pp=2, layers_per_virtual=2),
            {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]},
        ),
        (
            dict(num_layers=8, pp=2, virtual=4),
            {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3], (0, 2): [4], (1, 2): [5], (0, 3): [6], (1, 3): [7]},
        ),
        (
            dict(num_layers=12, pp=3, virtual=2),
            {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4, 5], (0, 1): [6, 7], (1, 1): [8, 9], (2, 1): [10, 11]},
        ),
    ],
)
def test_layers_for_stage(layout, expected):
    cfg = make_config(
        MODEL,
        num_layers=layout["num_layers"],
        pipeline_model_parallel_size=layout["pp"],
        decoder_first_pipeline_num_layers=layout.get("first"),
        decoder_last_pipeline_num_layers=layout.get("last"),
        num_layers_per_virtual_pipeline_stage=layout.get("layers_per_virtual"),
        num_virtual_stages_per_pipeline_rank=layout.get("virtual"),
    )
    got = {key: layers_for_stage(cfg, *key) for key in expected}
    assert got == expected
    assert sorted(i for layers in got.values() for i in layers) == list(range(layout["num_layers"]))


def test_attention_rope_and_swiglu_match_naive_formulas():
    """The TP=1 building blocks against independent textbook formulas (Megatron conventions)."""
    from megalm.transformer import MLP, RotaryEmbedding, SelfAttention, apply_rotary

    cfg = make_config(MODEL, CONFIGS["rope-RMSNorm-SwiGLU-nobias-untied-GQA"], add_bias_linear=True)
    m = cfg.model
    heads, groups, d, s, b = m.num_attention_heads, m.num_query_groups, m.head_dim, SEQ, BATCH
    g = torch.Generator().manual_seed(0)
    attention = SelfAttention(m, tp_group=get_process_groups().tp, cp_group=get_process_groups().cp)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(s, b, m.hidden_size, generator=g)
    # Grouped QKV layout: per group [q heads of the group; k; v].
    mixed = (x @ attention.linear_qkv.weight.t() + attention.linear_qkv.bias).view(s, b, groups, -1)
    q_per_group = heads // groups
    q = mixed[..., : q_per_group * d].reshape(s, b, groups, q_per_group, d)
    k, v = mixed[..., q_per_group * d : (q_per_group + 1) * d], mixed[..., (q_per_group + 1) * d :]
    scores = torch.einsum("sbgjd,tbgd->bgjst", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bgjst,tbgd->sbgjd", scores.softmax(-1), v).reshape(s, b, heads * d)
    expected = context @ attention.linear_proj.weight.t() + attention.linear_proj.bias
    assert _rel(attention(x), expected) < 1e-6

    rope = RotaryEmbedding(head_dim=8, rotary_percent=0.5, base=100.0)
    positions = torch.tensor([[0, 3, 7]])
    cos, sin = rope.tables(positions, 3, "cpu")
    t = torch.randn(3, 1, 2, 8, generator=g)
    rotated = apply_rotary(t, cos, sin)
    angles = positions.t().float().view(3, 1, 1, 1) * 100.0 ** (-torch.arange(0, 4, 2) / 4.0)
    z = torch.complex(t[..., 0:2], t[..., 2:4]) * torch.exp(1j * angles)  # pairs (i, i + rot/2)
    assert _rel(rotated[..., :4], torch.cat([z.real, z.imag], -1)) < 1e-6
    assert torch.equal(rotated[..., 4:], t[..., 4:])

    mlp = MLP(m, tp_group=get_process_groups().tp)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    gate_w, up_w = mlp.linear_fc1.weight.chunk(2, 0)
    gate_b, up_b = mlp.linear_fc1.bias.chunk(2, 0)
    hidden = torch.nn.functional.silu(x @ gate_w.t() + gate_b) * (x @ up_w.t() + up_b)
    assert _rel(mlp(x), hidden @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias) < 1e-6


def test_squared_relu_mlp_matches_the_formula_forward_and_backward():
    """``--squared-relu``: ``fc2(relu(fc1 x + b1)^2) + b2``, its output and every gradient against plain
    autograd on that formula, eager and compiled-plan activations alike; the default FFN is 4h (not gated)."""
    from megalm.fusions.activations import bias_squared_relu
    from megalm.transformer import MLP

    default = make_config(MODEL, squared_relu=True, ffn_hidden_size=None).model
    assert default.ffn_hidden_size == 4 * default.hidden_size and not default.gated_linear_unit
    m = make_config(MODEL, squared_relu=True).model
    g = torch.Generator().manual_seed(5)
    mlp = MLP(m, tp_group=get_process_groups().tp)
    assert mlp.bias_activation in (bias_squared_relu, bias_squared_relu.eager)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(SEQ, BATCH, m.hidden_size, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = mlp(x1)
    ref_params = [p.detach().clone().requires_grad_() for p in mlp.parameters()]
    w1, b1, w2, b2 = (
        dict(zip([n for n, _ in mlp.named_parameters()], ref_params))[k]
        for k in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
    )
    ref = torch.relu(x2 @ w1.t() + b1) ** 2 @ w2.t() + b2
    assert (ref > 0).any() and _rel(out, ref) < 1e-6
    grad = torch.randn(ref.shape, generator=g)
    out.backward(grad)
    ref.backward(grad)
    assert _rel(x1.grad, x2.grad) < 1e-6
    for p, r in zip(mlp.parameters(), ref_params):
        assert _rel(p.grad, r.grad) < 1e-6
    assert bias_squared_relu.eager(torch.tensor([-2.0, 0.5, 3.0]), None).tolist() == [0.0, 0.25, 9.0]


@pytest.mark.parametrize("other", ["swiglu", "quick_geglu", "openai_gelu"])
def test_squared_relu_refuses_another_activation(other):
    from megalm.config.sections import ConfigError

    with pytest.raises(ConfigError, match=f"--squared-relu and --{other.replace('_', '-')} each choose"):
        make_config(MODEL, squared_relu=True, **{other: True})


def test_param_info_records_and_tied_weights():
    """One typed record per parameter (what checkpointing, DDP and the optimizer read), the tied
    weights the model exposes, Megatron's attribute names derived from the record and read back
    when a user module sets them, and an impossible record refused."""
    from megalm.tensor_parallel.param_info import ParamInfo, ParamLayoutError, param_info, set_param_info

    model = GPTModel(
        make_config(MODEL, CONFIGS["learned-LayerNorm-GELU-bias-tied-MHA"]), process_groups=get_process_groups()
    )
    word = model.embedding.word_embeddings.weight
    assert model.tied_weights() == [word]
    assert param_info(word) == ParamInfo(tensor_parallel=True, partition_dim=0, tied=True, vocab_unpadded=VOCAB)
    fc1 = model.decoder.layers["0"].mlp.linear_fc1.weight
    assert param_info(fc1) == ParamInfo(tensor_parallel=True, partition_dim=0)
    proj_bias = model.decoder.layers["0"].self_attention.linear_proj.bias
    assert param_info(proj_bias).replicated and not param_info(proj_bias).sequence_parallel
    assert [n for n, p in model.named_parameters() if param_info(p).tied] == ["embedding.word_embeddings.weight"]
    assert word.tensor_model_parallel and word.partition_dim == 0 and word.shared_embedding and word.allreduce
    assert copy.deepcopy(model).process_groups is model.process_groups  # a copied model shares its groups
    untied = GPTModel(
        make_config(MODEL, CONFIGS["rope-RMSNorm-SwiGLU-nobias-untied-GQA"]), process_groups=get_process_groups()
    )
    assert untied.tied_weights() == [] and not any(param_info(p).tied for p in untied.parameters())
    assert param_info(untied.decoder.layers["1"].mlp.linear_fc1.weight).partition_stride == 2  # [gate; up]
    last = GPTModel(
        make_config(MODEL, CONFIGS["learned-LayerNorm-GELU-bias-tied-MHA"]),
        pre_process=False,
        post_process=True,
        layer_numbers=[1],
        process_groups=get_process_groups(),
    )
    assert last.tied_weights() == [last.output_layer.weight]
    assert param_info(last.output_layer.weight) == ParamInfo(
        tensor_parallel=True,
        partition_dim=0,
        tied=True,
        vocab_unpadded=VOCAB,
        copy_of="embedding.word_embeddings.weight",
    )
    assert param_info(word).copy_of is None  # the source is what a checkpoint stores

    plain = torch.nn.Linear(2, 2)
    assert param_info(plain.weight) == ParamInfo()
    plain.weight.allreduce, plain.weight.sequence_parallel = False, True  # marked the Megatron way
    assert param_info(plain.weight) == ParamInfo(expert=True, sequence_parallel=True)
    set_param_info(plain.bias, tensor_parallel=True, partition_dim=0, vocab_unpadded=1)
    set_param_info(plain.bias, vocab_unpadded=None)
    assert param_info(plain.bias) == ParamInfo(tensor_parallel=True, partition_dim=0)
    assert "vocab_unpadded" not in plain.bias.__dict__
    with pytest.raises(ParamLayoutError, match="partition_dim -1"):
        set_param_info(plain.weight, partition_dim=1)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_scales_by_one_plus_a_zero_initialised_weight(normalization):
    """--apply-layernorm-1p: norm weights start at 0; the norm is x_hat * (1 + w) (+ b); a model with it
    equals the plain model whose norm weights are 1 + w."""
    from megalm.transformer.norm import build_norm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    norm = build_norm(normalization, 16, 1e-5, zero_centered_gamma=True)  # initialised by the model (below)
    with torch.no_grad():
        norm.weight.normal_()
        getattr(norm, "bias", norm.weight).normal_()
    if normalization == "RMSNorm":
        expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + norm.weight)
    else:
        centered = x - x.mean(-1, keepdim=True)
        expected = centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + norm.weight) + norm.bias
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)

    overrides = dict(CONFIGS["rope-RMSNorm-SwiGLU-nobias-untied-GQA"], normalization=normalization)
    one_p, plain = (
        GPTModel(make_config(MODEL, overrides, apply_layernorm_1p=True), process_groups=get_process_groups()),
        GPTModel(make_config(MODEL, overrides), process_groups=get_process_groups()),
    )
    norm_names = [n for n, _ in one_p.named_parameters() if "layernorm.weight" in n]
    assert len(norm_names) == 5 and all(torch.count_nonzero(one_p.get_parameter(n)) == 0 for n in norm_names)
    with torch.no_grad():
        for name, p in one_p.named_parameters():
            p.normal_(0, 0.05) if "layernorm.weight" in name else None
            plain.get_parameter(name).copy_(p + 1 if "layernorm.weight" in name else p)
    tokens, positions, _, _ = make_batch(0)
    torch.testing.assert_close(one_p(tokens, positions), plain(tokens, positions), rtol=1e-5, atol=1e-5)


def test_qk_layernorm_and_qkv_bias_match_naive_formulas():
    """--qk-layernorm: RMSNorm of every query and key head over head_dim (own weights) before attention;
    --add-qkv-bias: linear_qkv has a bias under --disable-bias-linear, linear_proj none."""
    from megalm.transformer import SelfAttention

    overrides = dict(CONFIGS["rope-RMSNorm-SwiGLU-nobias-untied-GQA"], qk_layernorm=True, add_qkv_bias=True)
    m = make_config(MODEL, overrides).model
    heads, groups, d, s, b = m.num_attention_heads, m.num_query_groups, m.head_dim, SEQ, BATCH
    g = torch.Generator().manual_seed(1)
    attention = SelfAttention(m, tp_group=get_process_groups().tp, cp_group=get_process_groups().cp)
    assert attention.linear_qkv.bias is not None and attention.linear_proj.bias is None
    names = sorted(n for n, _ in attention.named_parameters())
    assert names == [
        "k_layernorm.weight",
        "linear_proj.weight",
        "linear_qkv.bias",
        "linear_qkv.weight",
        "q_layernorm.weight",
    ]
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(s, b, m.hidden_size, generator=g)

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + m.norm_epsilon) * w

    mixed = (x @ attention.linear_qkv.weight.t() + attention.linear_qkv.bias).view(s, b, groups, -1)
    q_per_group = heads // groups
    q = rms(mixed[..., : q_per_group * d].reshape(s, b, groups, q_per_group, d), attention.q_layernorm.weight)
    k = rms(mixed[..., q_per_group * d : (q_per_group + 1) * d], attention.k_layernorm.weight)
    v = mixed[..., (q_per_group + 1) * d :]
    scores = torch.einsum("sbgjd,tbgd->bgjst", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.einsum("bgjst,tbgd->sbgjd", scores.softmax(-1), v).reshape(s, b, heads * d)
    assert _rel(attention(x), context @ attention.linear_proj.weight.t()) < 1e-6


def test_the_rng_tracker_is_the_models_and_every_layer_forks_it():
    """The tracker is passed in, not looked up: every module of a model (MTP included) holds
    the one the model was given; attention dropout forks it (an unseeded tracker refuses, a seeded
    one's model-parallel stream advances and sets the mask), and recomputation restores it."""
    from megalm.tensor_parallel import RNGStatesTracker

    overrides = dict(attention_dropout=0.5, mtp_num_layers=1)
    overrides["recompute_granularity"] = "full"
    overrides.update(recompute_method="uniform", recompute_num_layers=1)
    cfg, groups = make_config(MODEL, overrides), get_process_groups()
    tracker = RNGStatesTracker()
    model = GPTModel(cfg, process_groups=groups, rng_tracker=tracker).train()
    holders = [name for name, module in model.named_modules() if hasattr(module, "rng_tracker")]
    assert {"", "embedding", "decoder", "decoder.layers.0", "decoder.layers.0.self_attention"} <= set(holders)
    assert "mtp.layers.0.transformer_layer.self_attention" in holders
    assert all(model.get_submodule(name).rng_tracker is tracker for name in holders)
    tokens, positions, labels, _ = make_batch(0)
    with pytest.raises(RuntimeError, match="not initialized"):
        model(tokens, positions, labels)
    model_parallel_manual_seed(5, groups, tracker)
    before = tracker.get_states()["model-parallel-rng"]
    first = model(tokens, positions, labels)
    first.sum().backward()  # recomputation under the restored streams: no error, same masks
    after = tracker.get_states()["model-parallel-rng"]
    assert not torch.equal(before, after)  # the forward drew its masks from this tracker
    model_parallel_manual_seed(5, groups, tracker)
    assert torch.equal(model(tokens, positions, labels), first)  # same streams, same masks
    model_parallel_manual_seed(6, groups, tracker)  # another model-parallel seed: other masks
    torch.manual_seed(5 + 100 * 0)  # the default stream as seed 5 left it
    assert not torch.equal(model(tokens, positions, labels), first)

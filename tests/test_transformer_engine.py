"""``--transformer-impl transformer_engine`` and ``--fp8-*`` against the CPU stand-in of Transformer
Engine in tests/te_standin (real TE needs a GPU; these tests check megalm's side of the API:
arguments, parameter layout and names, communication, the fp8 region, checkpoints, refusals).

* TE layers give the local implementation's loss and gradients (1e-5, fp32) from the same seed,
  in one process and on TP 2 with and without sequence parallelism (one spawned 2-rank group);
* checkpoints are interchangeable (canonical names, no TE extra state saved), across layouts too;
* the fp8 recipe follows the flags and every model chunk's layers run inside ``fp8_autocast``
  with the tensor x data-parallel amax group;
* refusals name the problem: TE absent, fp8 without TE layers, fp8 shapes, recompute, old GPUs.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.checkpoint.dcp_io import saved_tensor_shapes
from megalm.checkpoint.load import load_checkpoint
from megalm.checkpoint.save import save_checkpoint
from megalm.config import ConfigError, parse_config
from megalm.fusions import BackendUnavailable, plan_fusions
from megalm.models import GPTModel
from megalm.optimizer import build_optimizer
from megalm.parallel_state import get_process_groups
from megalm.param_layout import model_parameters, param_spec
from megalm.parameter_names import canonical_name
from megalm.tensor_parallel import gather_tensor_parallel_grad, gather_tensor_parallel_param
from megalm.transformer.fp8 import fp8_recipe
from tests import te_standin
from tests.configs import SMALL_GPT, make_config
from tests.distributed_harness import run_distributed
from tests.numerics import relative_error
from tests.test_gpt_model import _run_step as _step

VOCAB, SEQ, BATCH = 50, 8, 2
TE = "transformer_engine"
CONFIGS = {
    "gpt2": dict(position_embedding_type="learned_absolute"),  # LayerNorm, GELU, biases, tied, MHA
    "llama": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
    ),
    "swiglu-bias": dict(position_embedding_type="rope", swiglu=True),  # fc1 [gate; up] with a bias (stride 2)
}
ONE_PROCESS_ONLY = {  # megalm's attention core under TE, selective recompute; MoE layers (local experts)
    "llama-unfused-selective": dict(CONFIGS["llama"], attention_backend="unfused", recompute_granularity="selective"),
    "moe": dict(CONFIGS["llama"], num_experts=2, moe_router_topk=1, moe_layer_freq=[0, 1]),
    "llama-layernorm-1p": dict(CONFIGS["llama"], apply_layernorm_1p=True),  # TE's zero_centered_gamma
}


# The model of these tests (tests/test_gpt_model.py's, local layers unless a test asks for TE's).
MODEL = dict(SMALL_GPT, seq_length=SEQ, vocab_size=VOCAB, transformer_impl="local", micro_batch_size=BATCH, seed=4321)


def make_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, positions, labels, torch.rand(BATCH, SEQ, generator=g)


def _snapshot(model, batch) -> dict:
    """Loss and full (gathered) weights and gradients by canonical name."""
    loss = _step(model, batch)
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    return {
        "loss": loss,
        "weights": {n: gather_tensor_parallel_param(p, group=get_process_groups().tp) for n, p in named},
        "grads": {n: gather_tensor_parallel_grad(p, group=get_process_groups().tp) for n, p in named},
    }


def _contract_problems(model, sp: bool) -> list:
    """megalm's parameter contract on a TE model: TP attributes, init rule, SP flags, SwiGLU stride."""
    problems = []
    for name, p in model.named_parameters():
        canonical = canonical_name(name)
        if not all(hasattr(p, a) for a in ("tensor_model_parallel", "partition_dim", "partition_stride", "init_kind")):
            problems.append(f"{name}: attributes missing")
        norm = "layernorm" in canonical
        if norm and (p.tensor_model_parallel or bool(getattr(p, "sequence_parallel", False)) != sp):
            problems.append(f"{name}: a norm weight must be replicated, sequence_parallel={sp}")
        if canonical.endswith(".mlp.linear_fc1.weight") and model.cfg.model.swiglu and p.partition_stride != 2:
            problems.append(f"{name}: SwiGLU fc1 needs partition_stride 2")
    return problems


def _compare(tag: str, got: dict, reference: dict) -> dict:
    errors = {
        f"{tag} names": float(set(got["weights"]) != set(reference["weights"])),
        f"{tag} loss": relative_error(got["loss"], reference["loss"]),
    }
    for n, w in reference["weights"].items():
        errors[f"{tag} weight {n}"] = float(not torch.equal(got["weights"][n], w))  # same init: bit-identical
        errors[f"{tag} grad {n}"] = relative_error(got["grads"][n], reference["grads"][n])
    return errors


def _assert_small(errors: dict, minimum_checks: int, tolerance: float = 1e-5):
    assert len(errors) >= minimum_checks
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    assert not bad, f"{len(bad)} of {len(errors)} checks failed: {dict(list(bad.items())[:20])}"


@pytest.fixture
def te(monkeypatch):
    module = te_standin.install(monkeypatch)
    yield module
    te_standin.uninstall()


# --- one process ------------------------------------------------------------------------------


def test_te_layers_match_local_layers_in_one_process(te):
    errors = {}
    for i, (name, overrides) in enumerate({**CONFIGS, **ONE_PROCESS_ONLY}.items()):
        batch = make_batch(i)
        reference = _snapshot(GPTModel(make_config(MODEL, overrides), process_groups=get_process_groups()), batch)
        model = GPTModel(make_config(MODEL, overrides, transformer_impl=TE), process_groups=get_process_groups())
        errors.update(_compare(name, _snapshot(model, batch), reference))
        assert not _contract_problems(model, sp=False), name
        layer = model.decoder.layers["0"]
        assert isinstance(layer.input_layernorm, torch.nn.Identity)
        assert isinstance(layer.self_attention.linear_qkv, te.LayerNormLinear)
        assert isinstance(layer.self_attention.linear_proj, te.Linear)
        assert isinstance(layer.mlp.linear_fc1, te.LayerNormLinear) and isinstance(layer.mlp.linear_fc2, te.Linear)
        names = [n for n, _ in model.named_parameters()]
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
        plan = model.fusion_plan.describe()
        if name == "moe":  # MoE layers keep megalm's pre-MLP norm and experts, and the log says so
            assert "transformer: te, MoE experts local" in plan
            assert not isinstance(model.decoder.layers["1"].pre_mlp_layernorm, torch.nn.Identity)
            assert "decoder.layers.1.pre_mlp_layernorm.weight" in names
        else:
            assert "transformer: te |" in plan or plan.endswith("transformer: te")
        attention = layer.self_attention.te_core_attention
        assert (attention is None) == (name == "llama-unfused-selective")
        assert ("attention: te" in plan) == (attention is not None) and "fp8" not in plan
    _assert_small(errors, minimum_checks=5 * 20)


# --- tensor parallel (one spawned 2-rank group) -------------------------------------------------


def _te_modules(model):
    return [m for m in model.modules() if type(m).__name__ in ("Linear", "LayerNormLinear")]


def _tensor_parallel_rank(ckpt_root: str):
    te_standin.install()
    from transformer_engine.pytorch import fp8 as te_fp8

    batches = {name: make_batch(i) for i, name in enumerate(CONFIGS)}
    parallel_state.destroy_model_parallel()
    references = {
        name: _snapshot(GPTModel(make_config(MODEL, o), process_groups=get_process_groups()), batches[name])
        for name, o in CONFIGS.items()
    }
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    errors, saved = {}, None
    for name, overrides in CONFIGS.items():
        for sp in (False, True):
            model = GPTModel(
                make_config(MODEL, overrides, tensor_model_parallel_size=2, sequence_parallel=sp, transformer_impl=TE),
                process_groups=get_process_groups(),
            )
            errors.update(_compare(f"{name} tp=2 sp={sp}", _snapshot(model, batches[name]), references[name]))
            errors[f"{name} sp={sp} contract"] = float(len(_contract_problems(model, sp)))
            if name == "llama" and sp:
                save_checkpoint(ckpt_root, 3, [model])  # a TE TP 2 checkpoint, loaded at TP 1 below
                saved = {
                    n: gather_tensor_parallel_param(p, group=get_process_groups().tp)
                    for n, p in model_parameters([model]).items()
                }

    # fp8: every TE module's forward inside one fp8_autocast region per forward, amaxes reduced over TP x DP.
    te_fp8.ENTERED.clear()
    model = GPTModel(
        make_config(
            MODEL,
            CONFIGS["llama"],
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            transformer_impl=TE,
            fp8_format="hybrid",
        ),
        process_groups=get_process_groups(),
    )
    loss = _step(model, batches["llama"])  # the stand-in computes in fp32: the bf16/fp32 loss
    recipe, group = te_fp8.ENTERED[0]
    errors["fp8 regions entered != 1"] = float(len(te_fp8.ENTERED) != 1)
    errors["fp8 group is not TP x DP"] = float(dist.get_process_group_ranks(group) != [0, 1])
    errors["fp8 modules outside the region"] = float(
        any(m.fp8_forwards != 1 or m.fp8_meta["recipe"] is not recipe for m in _te_modules(model))
    )
    errors["fp8 loss"] = relative_error(loss, references["llama"]["loss"])
    te_fp8.ENTERED.clear()  # it holds the group: a reused rank keeping it would retire
    return errors, saved


def test_te_layers_on_tensor_parallel_ranks_match_local_and_checkpoint_across_layouts(tmp_path):
    results = run_distributed(_tensor_parallel_rank, world_size=2, args=(str(tmp_path),), timeout=180)
    for errors, _ in results:
        _assert_small(errors, minimum_checks=3 * 2 * 20)
    saved = results[0][1]
    local = GPTModel(make_config(MODEL, CONFIGS["llama"]), process_groups=get_process_groups())  # TP 1, local layers
    load_checkpoint(str(tmp_path), [local], finetune=True)
    loaded = dict(local.named_parameters())
    assert set(loaded) == set(saved)
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)


# --- checkpoints ----------------------------------------------------------------------------------


def _perturbed(cfg, seed: int):
    model = GPTModel(cfg, process_groups=get_process_groups())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _trained_optimizer(cfg, model):
    optimizer = build_optimizer(cfg, [model], report_memory=False, process_groups=get_process_groups())
    _step(model, make_batch(9))
    optimizer.step()
    return optimizer


def test_checkpoints_are_interchangeable_between_te_and_local_models(te, tmp_path):
    """Same keys (canonical names), same tensors, optimizer state included; TE's fp8 extra state
    (pickled) is not saved, so loading stays pickle-free."""
    for source_impl, target_impl in ((TE, "local"), ("local", TE)):
        root = str(tmp_path / f"{source_impl}-to-{target_impl}")
        source_cfg = make_config(MODEL, CONFIGS["gpt2"], transformer_impl=source_impl)
        target_cfg = make_config(MODEL, CONFIGS["gpt2"], transformer_impl=target_impl)
        source = _perturbed(source_cfg, seed=1)
        optimizer = _trained_optimizer(source_cfg, source)
        path = save_checkpoint(root, 1, [source], optimizer=optimizer, config=source_cfg.to_dict())
        keys = saved_tensor_shapes(path)
        local_names = {
            n
            for n, _ in GPTModel(
                make_config(MODEL, CONFIGS["gpt2"]), process_groups=get_process_groups()
            ).named_parameters()
        }
        assert {k[len("model.") :] for k in keys if k.startswith("model.")} == local_names
        assert not any("extra_state" in k or "layer_norm_weight" in k for k in keys)

        target = _perturbed(target_cfg, seed=2)
        target_optimizer = _trained_optimizer(target_cfg, target)
        load_checkpoint(root, [target], optimizer=target_optimizer)
        want = {n: param_spec(p, groups=get_process_groups()).local for n, p in model_parameters([source]).items()}
        got = {n: param_spec(p, groups=get_process_groups()).local for n, p in model_parameters([target]).items()}
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
        want_state = optimizer.sharded_param_state()
        got_state = target_optimizer.sharded_param_state()
        assert set(got_state) == set(want_state) == set(want)
        assert all(torch.equal(got_state[n][k], t) for n, tensors in want_state.items() for k, t in tensors.items())


# --- fp8 --------------------------------------------------------------------------------------------


def test_fp8_recipe_follows_flags_and_autocast_wraps_every_chunk(te):
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch import fp8 as te_fp8

    flags = [
        "--transformer-impl",
        TE,
        "--fp8-format",
        "e4m3",
        "--fp8-margin",
        "2",
        "--fp8-amax-history-len",
        "16",
        "--fp8-amax-compute-algo",
        "max",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "64",
        "--seq-length",
        "8",
    ]
    m = parse_config(flags).model
    assert fp8_recipe(m) == DelayedScaling(
        margin=2, fp8_format=Format.E4M3, amax_history_len=16, amax_compute_algo="max"
    )
    hybrid = parse_config(flags[:2] + ["--fp8-format", "hybrid"] + flags[10:]).model  # Megatron's defaults
    assert (hybrid.fp8_margin, hybrid.fp8_amax_history_len, hybrid.fp8_amax_compute_algo) == (0, 1, "most_recent")
    assert fp8_recipe(hybrid) == DelayedScaling(
        margin=0, fp8_format=Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent"
    )

    cfg = make_config(
        MODEL,
        CONFIGS["llama"],
        transformer_impl=TE,
        fp8_format="e4m3",
        fp8_margin=2,
        fp8_amax_history_len=16,
        fp8_amax_compute_algo="max",
    )
    model = GPTModel(cfg, process_groups=get_process_groups())
    assert "fp8: e4m3, delayed scaling (margin 2, amax history 16, max)" in model.fusion_plan.describe()
    te_fp8.ENTERED.clear()
    batch = make_batch(4)
    loss = _step(model, batch)
    assert [(r, g) for r, g in te_fp8.ENTERED] == [(fp8_recipe(cfg.model), None)]  # no parallel state: TE's default
    assert _te_modules(model) and all(
        m.fp8_forwards == 1 and m.fp8_meta["recipe"] == fp8_recipe(cfg.model) for m in _te_modules(model)
    )
    assert not te_fp8.is_fp8_enabled()  # left after the layers
    reference = GPTModel(
        make_config(MODEL, CONFIGS["llama"], transformer_impl=TE), process_groups=get_process_groups()
    )(*batch[:3])
    assert relative_error(loss, reference) < 1e-6  # the stand-in does not quantize

    # A later pipeline stage (no embedding) opens its own region around its layers.
    stage = GPTModel(cfg, pre_process=False, post_process=True, layer_numbers=[1], process_groups=get_process_groups())
    stage.set_input_tensor(torch.randn(SEQ, BATCH, 32))
    stage(None, batch[1], batch[2])
    assert len(te_fp8.ENTERED) == 2 and all(m.fp8_forwards == 1 for m in _te_modules(stage))


# --- refusals ---------------------------------------------------------------------------------------


def test_refusals_name_the_problem(monkeypatch):
    with pytest.raises(BackendUnavailable) as missing:  # CPU, no TE
        plan_fusions(make_config(MODEL, transformer_impl=TE).model)
    message = str(missing.value)
    assert "Transformer Engine is not available without a GPU" in message
    assert "pip install --no-build-isolation 'transformer_engine[pytorch]'" in message and "apex" not in message

    with pytest.raises(ConfigError, match="--fp8-format e4m3 needs --transformer-impl transformer_engine"):
        make_config(MODEL, fp8_format="e4m3")
    unvalidated = copy.deepcopy(make_config(MODEL).model)
    unvalidated.fp8_format = "hybrid"
    with pytest.raises(BackendUnavailable, match="--fp8-format hybrid needs --transformer-impl transformer_engine"):
        plan_fusions(unvalidated)
    with pytest.raises(ConfigError, match="recompute-granularity full is not supported"):
        make_config(
            MODEL,
            transformer_impl=TE,
            fp8_format="hybrid",
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        )
    with pytest.raises(ConfigError, match=r"widths divisible by 16, got \{'ffn/tp': 24\}"):
        make_config(MODEL, transformer_impl=TE, fp8_format="hybrid", ffn_hidden_size=24)
    with pytest.raises(ConfigError, match="tokens per rank"):
        make_config(MODEL, transformer_impl=TE, fp8_format="hybrid", seq_length=6)
    with pytest.raises(ConfigError, match="--fp8-amax-history-len >= 1"):
        make_config(MODEL, transformer_impl=TE, fp8_format="hybrid", fp8_amax_history_len=0)

    te = te_standin.install(monkeypatch)  # TE present, but a GPU without fp8
    try:
        monkeypatch.setattr(
            te.fp8,
            "check_fp8_support",
            lambda: (False, "Device compute capability 8.9 or higher required for FP8 execution."),
        )
        with pytest.raises(BackendUnavailable, match="cannot run fp8 here: Device compute capability 8.9"):
            plan_fusions(make_config(MODEL, transformer_impl=TE, fp8_format="hybrid").model)
        assert (
            plan_fusions(make_config(MODEL, transformer_impl=TE).model).transformer == "te"
        )  # bf16 TE layers still fine
    finally:
        te_standin.uninstall()

"""Importing Megatron-LM mixture-of-experts checkpoints, checked by logits.

The Megatron-LM layouts are built here with plain torch from a random megalm MoE model (SwiGLU
experts, a shared expert, sigmoid routing with an expert bias): ``torch_dist`` with the experts
stacked as ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, out, in]``
(the key megatron-core's SequentialMLP and TEGroupedMLP both save), each key in one chunk per layer
that has it (:class:`LayerChunks`), and legacy TP 2 x PP 2 x EP 2 files ``mp_rank_TT_PPP_EEE``
holding each EP rank's experts in SequentialMLP's (``local_experts.{j}.``), TEGroupedMLP's
(``linear_fc1.weight{j}``) or GroupedMLP's (``weight1`` / ``weight2``) local form; dense and MoE
layers mixed in both.  The imported model must give the original logits.
"""

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir
from megalm.conversion.errors import ConversionError
from megalm.conversion.megatron import import_from_megatron
from megalm.conversion.megatron_layouts import TorchDistCheckpoint
from megalm.fusions import EAGER
from megalm.models import GPTModel
from megalm.parallel_state import get_process_groups
from tests.configs import TINY_GPT, make_config
from tests.test_convert_megatron import (
    GPTOSS,
    LLAMA,
    PADDED,
    VOCAB,
    imported_logits,
    megatron_args,
    megatron_enum_module,
)
from tests.test_convert_megatron import tp_shard as dense_tp_shard

__all__ = ["megatron_enum_module"]  # the autouse fixture, imported so that it applies here

EXPERTS, TOPK, EXPERT_FFN, SHARED = 4, 2, 24, 16
MOE = dict(
    LLAMA,
    num_layers=4,
    num_experts=EXPERTS,
    moe_router_topk=TOPK,
    moe_ffn_hidden_size=EXPERT_FFN,
    moe_shared_expert_intermediate_size=SHARED,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.0,
    moe_grouped_gemm=True,
)


# gpt-oss's MoE: the clamped quick-GEGLU experts with biases, learnable sinks, sliding windows, YaRN.
GPTOSS_MOE = dict(MOE, **GPTOSS, swiglu=False, add_bias_linear=True, qk_layernorm=False)


def moe_model(layer_freq, fields=MOE):
    cfg = copy.deepcopy(
        make_config(TINY_GPT, fields, vocab_size=VOCAB, moe_layer_freq=layer_freq)
    )  # editable copy (frozen once validated)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    torch.manual_seed(0)
    model = GPTModel(cfg, fusion_plan=EAGER, process_groups=get_process_groups())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1.0)
            elif name.endswith(("bias", "softmax_offset")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=g))  # changes which experts are chosen
    return cfg, model.eval()


def moe_args(cfg, tp=1, pp=1, ep=1):
    m = cfg.model
    args = megatron_args(cfg, tp, pp)
    args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size = m.num_experts, TOPK, EXPERT_FFN
    args.moe_layer_freq, args.moe_shared_expert_intermediate_size = m.moe_layer_freq, SHARED
    args.moe_router_score_function, args.moe_router_enable_expert_bias = "sigmoid", True
    args.moe_router_topk_scaling_factor, args.moe_router_load_balancing_type = 2.0, "none"
    args.moe_aux_loss_coeff, args.moe_token_dispatcher_type, args.moe_grouped_gemm = 0.0, "flex", True
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, tp
    return args


def full_state(model):
    """``{megalm name: full tensor}``: parameters (vocabulary padded to ``PADDED``) and the expert biases."""
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        out[name] = torch.cat([out[name], torch.randn(PADDED - VOCAB, out[name].shape[1])])
    out.update({name: b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias")})
    return out


class LayerChunks(DefaultSavePlanner):
    """Saves each stacked key as one chunk per layer it has, as Megatron's layers each save their own
    offset: a key of the dense layers (or of the MoE ones) covers only those layers."""

    def __init__(self, layers_of):
        super().__init__()
        self.layers_of = layers_of  # {key: [layer indices]}

    def create_local_plan(self):
        items, plan = [], super().create_local_plan()
        for item in plan.items:
            key = item.index.fqn
            if key not in self.layers_of:
                items.append(item)
                continue
            shape = self.state_dict[key].shape
            for i in self.layers_of[key]:
                offsets, sizes = torch.Size([i] + [0] * (len(shape) - 1)), torch.Size([1, *shape[1:]])
                chunk = TensorWriteData(ChunkStorageMetadata(offsets, sizes), item.tensor_data.properties, shape)
                items.append(WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD, tensor_data=chunk))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        key = write_item.index.fqn
        if key in self.layers_of:
            i = write_item.index.offset[0]
            return self.state_dict[key][i : i + 1]
        return super().resolve_data(write_item)


def save_torch_dist(cfg, model, root, iteration=20):
    """Megatron's torch_dist layout: layers stacked on dim 0, experts on dim 1 under ``experts.experts``;
    Transformer Engine's fused norm names (a dense layer's pre-MLP norm in ``linear_fc1``, an MoE
    layer's apart); each key saved for the layers that have it."""
    path = checkpoint_dir(str(root), iteration)
    state, layers = {}, {}
    for name, t in full_state(model).items():
        if not name.startswith("decoder.layers."):
            state[name] = t
            continue
        i, rest = name[len("decoder.layers.") :].split(".", 1)
        if rest.startswith("mlp.experts.local_experts."):
            j, linear = rest[len("mlp.experts.local_experts.") :].split(".", 1)
            layers.setdefault("mlp.experts.experts." + linear, {}).setdefault(int(i), {})[int(j)] = t
        else:
            rest = rest.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            if not model.decoder.layers[i].is_moe:
                rest = rest.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
            layers.setdefault(rest, {})[int(i)] = t
    layers_of = {}
    for rest, per_layer in layers.items():
        if rest.startswith("mlp.experts.experts."):
            per_layer = {i: torch.stack([row[j] for j in range(EXPERTS)]) for i, row in per_layer.items()}
        some = next(iter(per_layer.values()))
        rows = [per_layer.get(i, torch.zeros_like(some)) for i in range(cfg.model.num_layers)]
        state["decoder.layers." + rest] = torch.stack(rows)
        layers_of["decoder.layers." + rest] = sorted(per_layer)
    dcp.save(state, checkpoint_id=path, no_dist=True, planner=LayerChunks(layers_of))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}, f)
    torch.save({"args": moe_args(cfg), "checkpoint_version": 3.0, "iteration": iteration}, f"{path}/common.pt")
    (root / TRACKER_FILENAME).write_text(str(iteration))


def local_form(sd, e, local, form):
    """EP rank ``e``'s experts of one file's TP shards, renamed to a megatron-core local form."""
    out, grouped = {}, {}
    for name, t in sd.items():
        if ".mlp.experts.local_experts." not in name:
            out[name] = t
            continue
        prefix, rest = name.split("local_experts.")
        j, linear = rest.split(".", 1)
        if not e * local <= int(j) < (e + 1) * local:
            continue
        jl = int(j) - e * local
        if form == "sequential":
            out[f"{prefix}local_experts.{jl}.{linear}"] = t
        elif form == "te_grouped":
            out[f"{prefix}{linear}{jl}"] = t  # linear_fc1.weight0
        else:
            grouped.setdefault((prefix, linear), {})[jl] = t
    for (prefix, linear), per_expert in grouped.items():  # GroupedMLP: [E_l, h, out] / [E_l, in, h] memory
        stacked = torch.stack([per_expert[j].t() for j in range(local)])
        which = "1" if linear.startswith("linear_fc1") else "2"
        h = stacked.shape[1] if which == "1" else stacked.shape[2]
        out[f"{prefix}weight{which}"] = stacked.reshape(h, -1) if which == "1" else stacked.reshape(-1, h)
    return out


def save_legacy(cfg, model, root, form, tp=2, pp=2, ep=2, iteration=30):
    path = checkpoint_dir(str(root), iteration)
    full = full_state(model)
    per_stage = cfg.model.num_layers // pp
    for stage in range(pp):
        sd = {}
        for name, t in full.items():
            if name.startswith("decoder.layers."):
                i, rest = name[len("decoder.layers.") :].split(".", 1)
                if stage * per_stage <= int(i) < (stage + 1) * per_stage:
                    sd[f"decoder.layers.{int(i) - stage * per_stage}.{rest}"] = t
            elif name.startswith("embedding.") and stage == 0:
                sd[name] = t
            elif name.startswith(("decoder.final_layernorm", "output_layer")) and stage == pp - 1:
                sd[name] = t
        for r in range(tp):
            shard = {k: dense_tp_shard(k, v, r, tp, True) for k, v in sd.items()}
            for e in range(ep):
                directory = f"{path}/mp_rank_{r:02d}_{stage:03d}_{e:03d}"
                os.makedirs(directory)
                model_sd = local_form(shard, e, EXPERTS // ep, form)
                state = {"args": moe_args(cfg, tp, pp, ep), "iteration": iteration, "model": model_sd}
                torch.save(state, f"{directory}/model_optim_rng.pt")
    (root / TRACKER_FILENAME).write_text(str(iteration))


def test_import_moe_torch_dist_and_legacy_forms_give_the_same_logits(tmp_path):
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    mixed = [1, 0, 1, 1]  # layer 1 dense
    cases = [(mixed, "torch_dist", None)] + [(mixed, "legacy", f) for f in ("sequential", "te_grouped", "grouped")]
    for freq, layout, form in cases:
        cfg, model = moe_model(freq)
        with torch.no_grad():
            reference = model(ids)[..., :VOCAB]
            biased = model.decoder.layers["0"].mlp.router.expert_bias.clone()
            model.decoder.layers["0"].mlp.router.expert_bias.zero_()
            assert (model(ids)[..., :VOCAB] - reference).abs().max() > 1e-3  # the expert bias matters
            model.decoder.layers["0"].mlp.router.expert_bias.copy_(biased)
        src, dst = tmp_path / f"megatron_{layout}_{form}", tmp_path / f"megalm_{layout}_{form}"
        src.mkdir()
        if layout == "torch_dist":
            save_torch_dist(cfg, model, src)
            saved = TorchDistCheckpoint(checkpoint_dir(str(src), 20))
            assert saved.saved_layers("decoder.layers.mlp.router.weight") == [0, 2, 3]
            assert saved.saved_layers("decoder.layers.mlp.linear_fc1.weight") == [1]
        else:
            save_legacy(cfg, model, src, form)
        r = import_from_megatron(str(src), str(dst), extra_args=["--expert-model-parallel-size", "2"])
        logits, reader = imported_logits(dst, ids)
        assert (logits - reference).abs().max() <= 1e-6, (layout, form)
        m = reader.config.model
        assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (EXPERTS, TOPK, EXPERT_FFN)
        assert m.moe_layer_freq == freq and m.moe_shared_expert_intermediate_size == SHARED
        assert m.moe_router_enable_expert_bias and m.moe_router_topk_scaling_factor == 2.0
        assert m.moe_token_dispatcher_type == "alltoall" and m.moe_grouped_gemm  # flex moves tokens as alltoall
        assert reader.config.parallel.expert_model_parallel_size == 2
        assert any("mixture of experts: 4 experts, top-2 sigmoid" in n for n in r.notes)
        if layout == "legacy":
            assert any("TP 2 x PP 2 x EP 2 files merged" in n for n in r.notes)


def test_import_gptoss_moe_gives_the_same_logits(tmp_path):
    """gpt-oss (torch_dist): experts' clamped quick-GEGLU fc1 ``[gate ; up]`` with biases, the sinks
    (``self_attention.core_attention.softmax_offset``, stacked ``[layers, heads]``), windows and YaRN."""
    cfg, model = moe_model(1, GPTOSS_MOE)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids)[..., :VOCAB]
    src, dst = tmp_path / "megatron", tmp_path / "megalm"
    src.mkdir()
    save_torch_dist(cfg, model, src)
    saved = TorchDistCheckpoint(checkpoint_dir(str(src), 20))
    assert saved.shapes["decoder.layers.self_attention.core_attention.softmax_offset"] == (4, 4)
    assert saved.shapes["decoder.layers.mlp.experts.experts.linear_fc1.bias"] == (4, EXPERTS, 2 * EXPERT_FFN)
    import_from_megatron(str(src), str(dst))
    logits, reader = imported_logits(dst, ids)
    assert (logits - reference).abs().max() <= 1e-6
    m = reader.config.model
    assert (m.quick_geglu, m.activation_func_clamp_value, m.softmax_type, m.window_size) == (
        True,
        0.5,
        "learnable",
        [3, 0],
    )


def test_moe_refusals(tmp_path):
    cfg, model = moe_model(1)
    src = tmp_path / "dist"
    src.mkdir()
    save_torch_dist(cfg, model, src)
    common = checkpoint_dir(str(src), 20) + "/common.pt"
    args = moe_args(cfg)
    args.moe_shared_expert_gate, args.moe_router_load_balancing_type = True, "sinkhorn"
    torch.save({"args": args, "iteration": 20}, common)
    with pytest.raises(ConversionError, match="shared-expert-gate True .*load-balancing-type sinkhorn"):
        import_from_megatron(str(src), str(tmp_path / "out1"))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_legacy(cfg, model, legacy, "sequential", tp=1, pp=1, ep=2)
    files = checkpoint_dir(str(legacy), 30)
    assert sorted(os.listdir(files)) == ["mp_rank_00_000_000", "mp_rank_00_000_001"]
    for e in range(2):  # Megatron names EP-only files mp_rank_TT_EEE
        os.rename(f"{files}/mp_rank_00_000_{e:03d}", f"{files}/mp_rank_00_{e:03d}")
    import_from_megatron(str(legacy), str(tmp_path / "ep_only"))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (imported_logits(tmp_path / "ep_only", ids)[0] - model(ids)[..., :VOCAB]).abs().max() <= 1e-6
    shutil.rmtree(f"{files}/mp_rank_00_001")
    with pytest.raises(ConversionError, match="saved args give PP 1 x EP 2, the directory holds TP 1 x PP 1 x EP 1"):
        import_from_megatron(str(legacy), str(tmp_path / "out2"))

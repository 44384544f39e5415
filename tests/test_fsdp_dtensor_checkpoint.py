"""``--ckpt-format fsdp_dtensor`` in one process (the resumes on real ranks, same and other DP size:
tests/test_sharding_strategy_training.py; Megatron-LM's FSDP and DeepSeek-V3 scripts save with it:
tests/test_megatron_scripts.py).

* the keys and shapes on disk are Megatron-FSDP's, checked against a fixture written from Megatron-LM's
  source (tests/fixtures/fsdp_dtensor/llama_keys.txt names the files and the commit);
* a bf16 model with an fp32 main copy and Adam's state reloads bit for bit (weights, main copy, moments,
  step), SwiGLU's fc1 split into its gate / up halves on disk, dense and expert;
* the halves on disk are the rows of megalm's fused fc1 (the same run saved as torch_dist);
* a checkpoint in the other format than --ckpt-format is refused by name, loads with --auto-detect-ckpt-format;
* the flags: both formats accepted, Megatron's others refused naming the flag; the convert and inspect tools
  refuse an fsdp_dtensor checkpoint by name.
"""

import copy
import os

import pytest
import torch

from megalm.checkpoint.fsdp_dtensor import CheckpointFormatError
from megalm.checkpoint.load import load_checkpoint
from megalm.checkpoint.model_state import optimizer_sharded_state
from megalm.checkpoint.safe_metadata import load_metadata
from megalm.checkpoint.save import save_checkpoint
from megalm.config import ConfigError, build_parser, config_from_args, validate_config
from megalm.optimizer import build_optimizer
from megalm.parallel_state import get_process_groups
from tests.checkpoint_fixtures import LLAMA
from tests.configs import NO_DROPOUT, TINY_GPT, make_config

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "fsdp_dtensor", "llama_keys.txt")
MOE = dict(LLAMA, num_experts=2, moe_ffn_hidden_size=8, moe_router_topk=1)


def _trained(model_fields, steps=2):
    """A bf16 GPT (TINY_GPT) with a mixed-precision Adam after ``steps`` steps: (cfg, model, optimizer)."""
    from megalm.models import GPTModel

    cfg = copy.deepcopy(make_config(TINY_GPT, NO_DROPOUT, model_fields, vocab_size=100))
    t = cfg.training
    t.optimizer, t.lr, t.clip_grad, t.bf16 = "adam", 1e-2, 1.0, True
    torch.manual_seed(0)
    model = GPTModel(cfg, process_groups=get_process_groups()).to(torch.bfloat16)
    opt = build_optimizer(cfg, [model], report_memory=False, process_groups=get_process_groups())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 100, (2, 16), generator=g)
        model.zero_grad()
        model(tokens, labels=torch.roll(tokens, -1, 1)).float().mean().backward()
        assert opt.step()[0]
    return cfg, model, opt


def _state(model, opt):
    out = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for k, v in optimizer_sharded_state(opt, [model]).items():
        out[k] = v.local.clone()
    return out


def _expected_keys():
    with open(FIXTURE) as f:
        lines = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return {line[0]: tuple(int(n) for n in line[1].split("x")) if line[1] != "-" else None for line in lines}


def test_keys_and_shapes_are_megatron_fsdp_s(tmp_path):
    cfg, model, opt = _trained(LLAMA)
    path = save_checkpoint(str(tmp_path), 3, [model], opt, config=cfg.to_dict(), ckpt_format="fsdp_dtensor")
    entries = load_metadata(path, allow_byte_entries=True).state_dict_metadata
    expected = _expected_keys()
    assert set(entries) == set(expected), set(entries) ^ set(expected)
    for key, shape in expected.items():
        if shape is None:  # a pickled object
            assert not hasattr(entries[key], "chunks"), key
        else:
            assert tuple(entries[key].size) == shape, key
    # Megatron-FSDP's weights are its fp32 main copy; the moments are fp32
    assert entries["model.module.decoder.layers.0.mlp.linear_fc1.weight_w"].properties.dtype == torch.float32
    assert entries["model.module.embedding.word_embeddings.weight"].properties.dtype == torch.float32
    assert not os.path.exists(os.path.join(path, "metadata.json"))  # Megatron would take it for torch_dist


@pytest.mark.parametrize("fields", [LLAMA, MOE], ids=["dense", "moe"])
def test_reload_is_bit_exact_and_halves_are_fc1_rows(tmp_path, fields):
    cfg, model, opt = _trained(fields)
    before = _state(model, opt)
    fsdp = save_checkpoint(str(tmp_path / "f"), 3, [model], opt, config=cfg.to_dict(), ckpt_format="fsdp_dtensor")
    save_checkpoint(str(tmp_path / "t"), 3, [model], opt, config=cfg.to_dict())
    _, fresh, fresh_opt = _trained(fields, steps=1)  # other values, state created
    common = load_checkpoint(str(tmp_path / "f"), [fresh], fresh_opt, ckpt_format="fsdp_dtensor")
    assert common["iteration"] == 3 and common["ckpt_format"] == "fsdp_dtensor"
    after = _state(fresh, fresh_opt)
    assert before.keys() == after.keys() and any(k.endswith(".main_param") for k in before)
    for k in before:
        assert torch.equal(before[k], after[k]), k

    # On disk, the gate / up halves are the rows of megalm's fused fc1 (dense: its (2, n) view; experts: [2n, h]).
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader

    full = MegalmCheckpointReader(str(tmp_path / "t")).load(
        [n for n in MegalmCheckpointReader(str(tmp_path / "t")).model_names if "linear_fc1.weight" in n]
    )
    assert full
    import torch.distributed.checkpoint as dcp

    from megalm.checkpoint.safe_metadata import SafeFileSystemReader

    for name, t in full.items():
        w, v = (t[0], t[1]) if t.dim() == 3 else t.chunk(2, 0)
        halves = {f"model.module.{name}_{h}": torch.empty(w.shape) for h in "wv"}
        reader = SafeFileSystemReader(fsdp, load_metadata(fsdp, allow_byte_entries=True))
        dcp.load(halves, storage_reader=reader, no_dist=True)
        assert torch.equal(halves[f"model.module.{name}_w"], w) and torch.equal(halves[f"model.module.{name}_v"], v)
    if fields is MOE:
        assert any(".experts.local_experts.1.linear_fc1.weight" in n for n in full)


def test_format_mismatch_is_refused_and_auto_detect_loads(tmp_path):
    cfg, model, opt = _trained(LLAMA, steps=1)
    save_checkpoint(str(tmp_path / "f"), 1, [model], opt, config=cfg.to_dict(), ckpt_format="fsdp_dtensor")
    save_checkpoint(str(tmp_path / "t"), 1, [model], opt, config=cfg.to_dict())
    with pytest.raises(CheckpointFormatError, match="is in the fsdp_dtensor format, this run gives --ckpt-format "):
        load_checkpoint(str(tmp_path / "f"), [model], opt, ckpt_format="torch_dist")
    with pytest.raises(CheckpointFormatError, match="--auto-detect-ckpt-format"):
        load_checkpoint(str(tmp_path / "t"), [model], opt, ckpt_format="fsdp_dtensor")
    from megalm.checkpoint.load import load_checkpoint_states
    from megalm.checkpoint.model_state import ModelOptimizerState, with_model

    for root in ("f", "t"):
        states = with_model(ModelOptimizerState([model], opt, get_process_groups()))
        common = load_checkpoint_states(
            str(tmp_path / root), states, get_process_groups(), ckpt_format="torch_dist", auto_detect=True
        )
        assert common["iteration"] == 1


def test_flags(tmp_path, capsys):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    base += ["--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "1"]

    def parse(*argv):
        return validate_config(config_from_args(build_parser().parse_args(base + list(argv))))

    assert parse().checkpoint.ckpt_format == "torch_dist"
    c = parse("--ckpt-format", "fsdp_dtensor", "--auto-detect-ckpt-format").checkpoint
    assert (c.ckpt_format, c.auto_detect_ckpt_format) == ("fsdp_dtensor", True)
    for other in ("torch", "zarr", "torch_dcp"):
        with pytest.raises(ConfigError, match=f"--ckpt-format {other} is not supported"):
            parse("--ckpt-format", other)

    # the tools read megalm's names: an fsdp_dtensor checkpoint is refused naming its format
    cfg, model, opt = _trained(LLAMA, steps=1)
    save_checkpoint(str(tmp_path), 1, [model], opt, config=cfg.to_dict(), ckpt_format="fsdp_dtensor")
    from megalm.cli.inspect_checkpoint import main as inspect_main

    assert inspect_main([str(tmp_path)]) == 2
    assert "is a --ckpt-format fsdp_dtensor checkpoint" in capsys.readouterr().err

    # one as Megatron-LM writes it (no common.json, no metadata.json): --load and the inspector point to
    # convert --from megatron, which imports it: the weights are the optimizer's fp32 main copy, exactly
    import shutil

    from megalm.checkpoint.errors import CheckpointError
    from megalm.checkpoint.resume import find_checkpoint
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.megatron import find_iteration_dir, import_from_megatron

    saved = _state(model, opt)
    path = os.path.join(str(tmp_path), "iter_0000001")
    os.remove(os.path.join(path, "common.json"))
    shutil.rmtree(os.path.join(path, "manifest"))
    assert find_iteration_dir(str(tmp_path)) == path
    with pytest.raises(CheckpointError, match="fsdp_dtensor.*import this one first.*convert.py --from megatron"):
        find_checkpoint(str(tmp_path))
    assert inspect_main([str(tmp_path)]) == 2
    assert "convert.py --from megatron" in capsys.readouterr().err
    r = import_from_megatron(str(tmp_path), str(tmp_path / "imported"), extra_args=["--vocab-size", "100"])
    assert any("Adam's optimizer state imported (moments and fp32 main weights, step 1)" in n for n in r.notes)
    reader = MegalmCheckpointReader(str(tmp_path / "imported"))
    assert reader.config.model == cfg.model
    weights = reader.load(reader.model_names)
    assert len(weights) == len(list(model.parameters()))
    for name, t in weights.items():
        assert torch.equal(t.reshape(-1), saved[f"optimizer.{name}.main_param"].reshape(-1)), name


@pytest.mark.parametrize("layers", ["llama", "moe", "moe-grouped"])
def test_transformer_engine_models_keep_their_module_names(tmp_path, monkeypatch, layers):
    """A Transformer Engine model (tests/te_standin) is saved under its own module tree's names, as
    Megatron-FSDP's TE model holds them (fused norms as ``linear_qkv.layer_norm_weight`` /
    ``linear_fc1.layer_norm_weight``; an MoE layer's ``pre_mlp_layernorm`` stays); with --moe-grouped-gemm the
    experts as TEGroupedMLP's ``linear_fc1.weight<index>`` (``weight<index>_w`` / ``_v`` split: Megatron-LM's
    fsdp_dtensor_checkpoint.py handle_experts_in_state_dict); a local model loads it, weights and optimizer."""
    from megalm.models import GPTModel
    from tests import te_standin
    from tests.configs import make_config
    from tests.test_transformer_engine import CONFIGS, MODEL, ONE_PROCESS_ONLY, make_batch

    te_standin.install(monkeypatch)
    try:
        grouped = layers == "moe-grouped"
        fields = {**MODEL, **CONFIGS.get(layers, ONE_PROCESS_ONLY.get(layers.replace("-grouped", ""), {}))}
        if grouped:
            fields["moe_grouped_gemm"] = True
        te_cfg = make_config(**dict(fields, transformer_impl="transformer_engine"))
        torch.manual_seed(0)
        te_model = GPTModel(te_cfg, process_groups=get_process_groups())
        te_opt = build_optimizer(te_cfg, [te_model], report_memory=False, process_groups=get_process_groups())
        te_model(*make_batch(0)[:2], labels=make_batch(0)[2]).float().mean().backward()
        assert te_opt.step()[0]
        kw = dict(config=te_cfg.to_dict(), ckpt_format="fsdp_dtensor")
        path = save_checkpoint(str(tmp_path), 1, [te_model], te_opt, **kw)
        raw = [n for n, _ in te_model.named_parameters()]
        before = _state(te_model, te_opt)
    finally:
        te_standin.uninstall()
    gated = ("linear_fc1.weight", "linear_fc1.bias")
    expected = {f"model.module.{n}{h}" for n in raw for h in (("_w", "_v") if n.endswith(gated) else ("",))}
    if grouped:  # Megatron's TEGroupedMLP: mlp.experts.linear_fc1.weight<expert>_w
        experts = ".mlp.experts.local_experts."
        expected = {k for k in expected if experts not in k}
        for e in range(2):
            layer = "model.module.decoder.layers.1.mlp.experts"
            expected |= {
                f"{layer}.linear_fc1.weight{e}_w",
                f"{layer}.linear_fc1.weight{e}_v",
                f"{layer}.linear_fc2.weight{e}",
            }
    entries = load_metadata(path, allow_byte_entries=True).state_dict_metadata
    saved = {k for k in entries if k.startswith("model.")}
    assert saved == expected and any(k.endswith("linear_qkv.layer_norm_weight") for k in saved)
    if layers.startswith("moe"):
        assert "model.module.decoder.layers.1.pre_mlp_layernorm.weight" in saved
    if grouped:
        opt_key = "optimizer.state.module.module.module.decoder.layers.1.mlp.experts.linear_fc1.weight1_v.exp_avg"
        assert opt_key in entries

    local_cfg = make_config(**fields)
    torch.manual_seed(1)
    local = GPTModel(local_cfg, process_groups=get_process_groups())
    local_opt = build_optimizer(local_cfg, [local], report_memory=False, process_groups=get_process_groups())
    load_checkpoint(str(tmp_path), [local], local_opt, ckpt_format="fsdp_dtensor")
    after = _state(local, local_opt)
    from megalm.parameter_names import canonical_name

    before = {k.replace(k[6:], canonical_name(k[6:])) if k.startswith("model.") else k: v for k, v in before.items()}
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k

    if grouped:  # as Megatron-LM writes it (no megalm files): convert --from megatron maps TEGroupedMLP's names
        import shutil

        import torch.distributed.checkpoint as dcp

        from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
        from megalm.conversion.megatron import import_from_megatron

        os.remove(os.path.join(path, "common.json"))
        shutil.rmtree(os.path.join(path, "manifest"))
        import_from_megatron(str(tmp_path), str(tmp_path / "imported"))
        reader = MegalmCheckpointReader(str(tmp_path / "imported"))
        weights = reader.load(reader.model_names)
        assert len(weights) == len(raw) and any(".mlp.experts.local_experts.1." in n for n in weights)
        adam = {f"optimizer.{n}.exp_avg": torch.zeros(reader.entries[f"optimizer.{n}.exp_avg"][0]) for n in weights}
        dcp.load(adam, checkpoint_id=reader.path, no_dist=True)
        for name, t in weights.items():
            n = t.numel()  # the vocabulary's padding rows trimmed: a prefix of the row-major elements
            assert torch.equal(t.reshape(-1), before[f"model.{name}"].reshape(-1)[:n]), name  # an fp32 model
            exp_avg = before[f"optimizer.{name}.exp_avg"].reshape(-1)[:n]
            assert torch.equal(adam[f"optimizer.{name}.exp_avg"].reshape(-1), exp_avg), name

"""Importing a checkpoint Megatron-LM wrote with ``--ckpt-format fsdp_dtensor`` (a Megatron-FSDP run).

The fixture is built as Megatron-LM (commit d98e8a64) writes it: ``megatron/training/checkpointing.py``
``generate_state_dict`` (``args``, ``checkpoint_version`` 3.0, ``iteration``, ``model`` from the FSDP wrapper's
``state_dict()``, ``optimizer``, ``opt_param_scheduler``, ``rerun_state_machine``, ``rng_state``),
``preprocess_fsdp_dtensor_state_dict`` (SwiGLU fc1 split into ``weight_w`` / ``weight_v``, in the model and the
optimizer state), ``get_rng_state`` (``{'(pp, tp)': [rng dict]}`` for fsdp_dtensor), and
``megatron/core/optimizer/distrib_optimizer.py`` ``sharded_param_state_fsdp_dtensor`` (``{"state": ...,
"param_to_group_meta": ...}`` keyed by ``module.module.module.<name>``), saved with
``torch.distributed.checkpoint.save`` into ``iter_XXXXXXX`` next to ``latest_checkpointed_iteration.txt`` (no
``metadata.json``, no ``common.pt``).  Transformer Engine's fused norm names and ``_extra_state`` are as a TE
model's module tree holds them.  The imported model must give the saved model's logits, and the optimizer
must resume with the saved Adam state.
"""

import io
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir
from megalm.conversion.errors import ConversionError
from megalm.conversion.megatron import import_from_megatron
from megalm.conversion.megatron_pickles import MegatronPickleError
from tests.test_convert_megatron import (  # noqa: F401 (megatron_enum_module: the autouse fixture)
    TE_NORMS,
    VOCAB,
    adam_state,
    assert_imported_adam_state,
    imported_logits,
    megatron_args,
    megatron_enum_module,
    padded_params,
    random_model,
)

ITERATION, GROUP_STEP = 20, 7


def megatron_names(model):
    """``{Megatron-FSDP TE model name: tensor}``: fused norm names, SwiGLU fc1 as its ``_w`` / ``_v`` halves."""
    out = {}
    for name, t in padded_params(model).items():
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers.") :].split(".", 1)
            name = f"decoder.layers.{i}.{TE_NORMS.get(rest, rest)}"
        if name.endswith("mlp.linear_fc1.weight"):
            gate, up = t.reshape(2, -1, t.shape[-1])
            out[name + "_w"], out[name + "_v"] = gate.clone(), up.clone()
        else:
            out[name] = t
    return out


def save_megatron_fsdp_dtensor(cfg, model, root, adam=True):
    weights = megatron_names(model)
    state = {"model": {f"module.{k}": t for k, t in weights.items()}}
    state["model"]["module.decoder.layers.0.self_attention.linear_qkv._extra_state"] = io.BytesIO(b"te fp8 state")
    if adam:
        opt = "module.module.module."
        state["optimizer"] = {
            "state": {opt + k: {s: adam_state(s, t) for s in ("exp_avg", "exp_avg_sq")} for k, t in weights.items()},
            "param_to_group_meta": {
                opt + k: {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "step": GROUP_STEP}
                for k in weights
            },
        }
    args = megatron_args(cfg)
    args.ckpt_format, args.use_megatron_fsdp, args.use_distributed_optimizer = "fsdp_dtensor", True, True
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": {},
    }
    state.update(
        args=args,
        checkpoint_version=3.0,
        iteration=ITERATION,
        opt_param_scheduler={"max_lr": 1e-4, "num_steps": ITERATION * 8, "decay_style": "cosine"},
        rerun_state_machine={"mode": "disabled", "sharded": {"rerun_requested": False}},
        rng_state={"(0, 0)": [rng]},
    )
    dcp.save(state, checkpoint_id=checkpoint_dir(str(root), ITERATION), no_dist=True)
    (root / TRACKER_FILENAME).write_text(str(ITERATION))
    return checkpoint_dir(str(root), ITERATION)


def test_fsdp_dtensor_imports_weights_and_adam_state_and_resumes(tmp_path):
    """Logits equal the saved model's; Adam's moments, main weights and the group's step load into megalm's
    optimizer; the checkpoint's rng / rerun / scheduler / _extra_state entries are skipped."""

    cfg, model = random_model("llama")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids)[..., :VOCAB]
    src, dst = tmp_path / "megatron", tmp_path / "megalm"
    src.mkdir()
    path = save_megatron_fsdp_dtensor(cfg, model, src)
    assert not os.path.exists(os.path.join(path, "metadata.json")) and not os.path.exists(path + "/common.json")
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert (
        "rng_state.(0, 0).0.torch_rng_state" in md
        and "optimizer.param_to_group_meta." + ("module.module.module.decoder.layers.0.mlp.linear_fc1.weight_w.step")
        in md
    )  # the fixture holds what Megatron's DCP save flattens to

    r = import_from_megatron(str(src), str(dst), extra_args=["--tensor-model-parallel-size", "2"])
    assert r.architecture == f"Megatron-LM fsdp_dtensor iter_{ITERATION:07d}"
    logits, reader = imported_logits(dst, ids)
    assert reference.abs().max() > 1.0 and (logits - reference).abs().max() <= 1e-6
    assert reader.config.parallel.tensor_model_parallel_size == 2 and reader.config.model.num_layers == 4
    imported = f"Adam's optimizer state imported (moments and fp32 main weights, step {GROUP_STEP})"
    assert any(imported in n for n in r.notes)

    assert_imported_adam_state(dst, reader.config, model, step=GROUP_STEP)


def test_fsdp_dtensor_weights_only_and_refusals(tmp_path):
    """Without optimizer state: weights only, said so; a plain DCP without model.module.* (torch_dcp) and a
    malicious args pickle are refused by name, running nothing; --load and the inspector point to the import."""
    from megalm.checkpoint.errors import CheckpointError
    from megalm.checkpoint.resume import find_checkpoint

    cfg, model = random_model("gpt")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(ids)[..., :VOCAB]
    src = tmp_path / "weights"
    src.mkdir()
    path = save_megatron_fsdp_dtensor(cfg, model, src, adam=False)
    r = import_from_megatron(path, str(tmp_path / "out"))  # the iteration directory itself
    assert (imported_logits(tmp_path / "out", ids)[0] - reference).abs().max() <= 1e-6
    assert any("not imported (weights only): the checkpoint holds no Adam moments" in n for n in r.notes)
    with pytest.raises(CheckpointError, match="fsdp_dtensor.*convert.py --from megatron"):
        find_checkpoint(str(src))

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    torch.save(Evil(), buffer)  # pickling records os.system, runs nothing
    forms = (("Megatron's save", Evil()), ("the converter's BytesIO", io.BytesIO(buffer.getvalue())))
    for i, (form, args) in enumerate(forms):
        evil = tmp_path / f"evil{i}"
        weight = {"module.embedding.word_embeddings.weight": torch.zeros(2)}
        dcp.save({"args": args, "model": weight}, checkpoint_id=str(evil), no_dist=True)
        with pytest.raises(MegatronPickleError, match=r"\(args\): refusing to unpickle the global .*system"):
            import_from_megatron(str(evil), str(tmp_path / "out2"))
        assert not marker.exists(), form

    plain = tmp_path / "torch_dcp"
    plain.mkdir()
    dcp.save({"weight": torch.zeros(2)}, checkpoint_id=str(plain), no_dist=True)
    with pytest.raises(ConversionError, match="without model.module.* tensors.*torch_dcp format is not imported"):
        import_from_megatron(str(plain), str(tmp_path / "out3"))

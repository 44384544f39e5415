"""Megatron-LM ``--save`` directory -> megalm checkpoint (``tools/checkpoint/convert.py --from megatron``).

Mixture-of-experts models (megatron-core's router, experts and shared expert) import too; a
router's ``expert_bias`` buffer (aux-loss-free balancing) is written beside the weights.

Reads one iteration (the tracker's, ``release``, or ``--iteration``) in either layout of
:mod:`megalm.conversion.megatron_layouts` (``torch_dist``, legacy ``mp_rank_XX[_YYY]``).  The
architecture comes from the checkpoint's own saved ``args`` (:mod:`megalm.conversion.megatron_args`,
read with ``torch.load(weights_only=True)`` and an exact allow-list,
:mod:`megalm.conversion.megatron_pickles`) and every tensor's shape is checked against it.  Names
map to megalm's: TE's fused norm names to ``input_layernorm`` / ``pre_mlp_layernorm``
(:func:`megalm.parameter_names.canonical_name`), ``_extra_state`` dropped, the padded vocabulary
trimmed to the true one, a SwiGLU ``linear_fc1`` ``[gate ; up]`` reshaped to ``[2, ffn, h]``.
Written with :func:`megalm.conversion.megalm_checkpoint.write_checkpoint` (full tensors, any
TP/PP layout loads it).  A Megatron-FSDP run's ``--ckpt-format fsdp_dtensor`` directory (a plain DCP
checkpoint, :mod:`megalm.conversion.megatron_fsdp_dtensor`) imports its weights and Adam's per-parameter
state.  A ``torch_dist`` checkpoint's Adam state (model space, or the distributed
optimizer's ``dp_reshardable`` flat buffers of a TP 1 x PP 1 run) is imported too
(:mod:`megalm.conversion.megatron_optimizer`), so ``--load`` resumes the optimizer; otherwise weights
only, and a note says so.
No communication.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalm.checkpoint.fsdp_dtensor import FSDP_DTENSOR
from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir
from megalm.config import (
    ConfigError,
    MegalmConfig,
    build_parser,
    config_from_args,
    validate_config,
    with_vocab_size,
)
from megalm.conversion.base import (
    OUTPUT_LAYER,
    VOCAB_ROWS,
    WORD_EMBEDDINGS,
    checkpoint_shapes,
    router_buffer_shapes,
)
from megalm.conversion.errors import ConversionError
from megalm.conversion.hf_files import DTYPES
from megalm.conversion.import_hf import ImportResult, _explicit_dests, build_config
from megalm.conversion.megalm_checkpoint import write_checkpoint
from megalm.conversion.megatron_args import MOE_TRAINING_FIELDS, megalm_fields, true_vocab_size
from megalm.conversion.megatron_flat_optimizer import place_parameters
from megalm.conversion.megatron_fsdp_dtensor import FsdpDtensorCheckpoint, is_plain_dcp
from megalm.conversion.megatron_layouts import (
    FLAT_OPTIMIZER_GROUPS_KEY,
    TorchDistCheckpoint,
    is_extra_state,
    merge_legacy,
    read_byte_entry,
)
from megalm.conversion.megatron_optimizer import iteration_of, optimizer_entries, saved_step
from megalm.errors import MegalmError
from megalm.parameter_names import canonical_name

_TOKENIZER_ARGS = (
    ("tokenizer_type", "--tokenizer-type"),
    ("tokenizer_model", "--tokenizer-model"),
    ("vocab_file", "--vocab-file"),
    ("merge_file", "--merge-file"),
)


def find_iteration_dir(root: str, iteration: Optional[int] = None) -> str:
    """The Megatron-LM iteration directory to read: ``root`` itself when it is one, else
    ``iter_<iteration>`` or the tracker's (an iteration number or ``release``)."""
    if not os.path.isdir(root):
        raise ConversionError(f"Megatron-LM checkpoint directory {root} does not exist")
    if iteration is None and (backend_of(root) is not None or os.path.isfile(os.path.join(root, ".metadata"))):
        return _checked(root)
    if iteration is None:
        tracker = os.path.join(root, TRACKER_FILENAME)
        if not os.path.isfile(tracker):
            raise ConversionError(f"{root} has no {TRACKER_FILENAME}: give --iteration N")
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return os.path.join(root, "release")
        try:
            iteration = int(text)
        except ValueError:
            raise ConversionError(f"{tracker} should hold an iteration number or 'release', found {text!r}") from None
    return _checked(checkpoint_dir(root, iteration))


def _checked(path: str) -> str:
    """``path`` when it is a Megatron-LM checkpoint megalm imports; else why not (by name)."""
    if backend_of(path) is None:
        raise ConversionError(
            f"{path} is not a Megatron-LM checkpoint (no metadata.json, no mp_rank_XX/model_optim_rng.pt, no "
            f"torch.distributed.checkpoint .metadata without megalm's common.json)"
        )
    return path


def backend_of(path: str) -> Optional[str]:
    """``metadata.json``'s ``sharded_backend`` (``torch_dist``, ``zarr``...), ``legacy`` for
    ``mp_rank_XX`` directories, ``fsdp_dtensor`` for a plain DCP directory (no megalm ``common.json``), None
    for none of them."""
    if is_plain_dcp(path):
        return FSDP_DTENSOR
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                return str(json.load(f).get("sharded_backend"))
        except (OSError, ValueError, AttributeError) as e:
            raise ConversionError(f"cannot read {meta}: {e}") from None
    if os.path.isdir(path) and any(
        name.startswith("mp_rank_") and os.path.isfile(os.path.join(path, name, "model_optim_rng.pt"))
        for name in os.listdir(path)
    ):
        return "legacy"
    return None


def _tokenizer(args: dict, extra_args: List[str]) -> Tuple[Optional[int], List[str], List[str]]:
    """``(vocabulary size, flags to record, notes)`` from the tokenizer the saved args name, when
    megalm has that tokenizer and its files are here (the user's ``--tokenizer-type`` wins; the user's
    ``--tokenizer-model`` / ``--vocab-file`` / ``--merge-file`` replace moved files)."""
    from megalm.tokenizers.build import create_tokenizer

    user = _flag_values(extra_args)
    if "--tokenizer-type" in user or not args.get("tokenizer_type"):
        return None, [], []
    given = {name: user.get(flag, args.get(name)) for name, flag in _TOKENIZER_ARGS}
    try:
        tok = create_tokenizer(
            given["tokenizer_type"],
            given["tokenizer_model"],
            args.get("vocab_size"),
            given["vocab_file"],
            given["merge_file"],
        )
    except MegalmError as e:
        return None, [], [f"the saved tokenizer could not be opened here ({e}); pass --tokenizer-type and its files"]
    record = [
        x
        for name, flag in _TOKENIZER_ARGS
        if given[name] is not None and flag not in user
        for x in (flag, str(given[name]))
    ]
    return tok.vocab_size, record, []


def _flag_values(argv: Sequence[str]) -> Dict[str, str]:
    """``{flag: value}`` of the ``--flag value`` / ``--flag=value`` pairs in ``argv``."""
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            flag, eq, value = a.partition("=")
            out[flag] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return out


def to_megalm_names(
    tensors: Dict[str, torch.Tensor], m, source: str, config_from: str = "the saved args", buffers: bool = True
) -> Dict[str, torch.Tensor]:
    """Megatron names/shapes -> megalm's, checked against the config ``m`` (every tensor used;
    ``config_from`` names where ``m`` came from in the messages; ``buffers`` False: parameters only,
    as in optimizer state)."""
    expected = {**checkpoint_shapes(m), **(router_buffer_shapes(m) if buffers else {})}
    legacy_model = sorted(k for k in tensors if k.startswith("language_model."))
    if legacy_model:
        raise ConversionError(
            f"{source}: tensors such as {legacy_model[0]} are Megatron's legacy (pre-mcore) model: megalm imports "
            f"Megatron-core models only"
        )
    out: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_extra_state(name):
            continue
        name = canonical_name(name)
        if name in VOCAB_ROWS:
            if t.shape[0] < m.vocab_size:
                raise ConversionError(
                    f"{source}: {name} has {t.shape[0]} rows, fewer than the vocabulary {m.vocab_size}"
                )
            t = t[: m.vocab_size]
        if name == OUTPUT_LAYER and not m.untie_embeddings_and_output_weights:
            continue  # a tied output layer's copy (checked below)
        fc1 = name.endswith((".mlp.linear_fc1.weight", ".mlp.linear_fc1.bias"))
        if fc1 and m.gated_linear_unit and t.shape[0] == 2 * m.ffn_hidden_size:
            t = t.reshape(2, m.ffn_hidden_size, *t.shape[1:])
        shared_fc1 = name.endswith((".mlp.shared_experts.linear_fc1.weight", ".mlp.shared_experts.linear_fc1.bias"))
        shared = m.moe_shared_expert_intermediate_size
        if shared_fc1 and m.gated_linear_unit and t.shape[0] == 2 * shared:
            t = t.reshape(2, shared, *t.shape[1:])
        if name not in expected:
            raise ConversionError(
                f"{source}: tensor {name} has no megalm counterpart for this model ({config_from} describe "
                f"no such part)"
            )
        if tuple(t.shape) != expected[name]:
            raise ConversionError(f"{source}: {name} has shape {tuple(t.shape)}, {config_from} imply {expected[name]}")
        out[name] = t
    if OUTPUT_LAYER in tensors and not m.untie_embeddings_and_output_weights:
        if not torch.equal(tensors[OUTPUT_LAYER][: m.vocab_size], out.get(WORD_EMBEDDINGS)):
            raise ConversionError(f"{source}: tied embeddings, but output_layer.weight differs from the word embedding")
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ConversionError(f"{source}: no tensor for {len(missing)} megalm parameters, e.g. {missing[:4]}")
    return out


def _optimizer_state(ckpt: TorchDistCheckpoint, m, source: str, directory: str, weights: Dict[str, torch.Tensor]):
    """``((entries, optimizer_common) or None, note)``: Megatron's Adam state in megalm's names
    (:mod:`megalm.conversion.megatron_optimizer`), from model-space keys or, failing those, from the
    distributed optimizer's ``dp_reshardable`` buffers placed by the saved ``weights`` (Megatron's names,
    :mod:`megalm.conversion.megatron_flat_optimizer`)."""
    params = sorted(checkpoint_shapes(m))
    if not m.untie_embeddings_and_output_weights:
        params = [p for p in params if p != OUTPUT_LAYER]
    states, common = ckpt.optimizer_states(m.num_layers), ckpt.common
    trainable = {
        k: t
        for k, t in weights.items()
        if not k.endswith(".expert_bias") and (k != OUTPUT_LAYER or m.untie_embeddings_and_output_weights)
    }
    try:
        buckets = [] if states else ckpt.flat_optimizer_buckets()
        states = place_parameters(buckets, trainable, ckpt.path) if buckets else states
    except ConversionError as e:
        return None, f"the optimizer state was not imported (weights only): {e}"
    if buckets:
        groups = read_byte_entry(ckpt.path, ckpt.metadata, FLAT_OPTIMIZER_GROUPS_KEY)
        common = {"optimizer": groups[0]} if groups is not None else {}
    step = saved_step(common)
    step = iteration_of(directory) if step is None else step

    def to_megalm(tensors):
        return to_megalm_names(tensors, m, source, buffers=False)

    entries, optimizer_common, note = optimizer_entries(states, to_megalm, params, step)
    if entries is not None and buckets:
        note += " (read from the distributed optimizer's dp_reshardable buffers)"
    return (None if entries is None else (entries, optimizer_common)), note


def _fsdp_dtensor_optimizer_state(ckpt: FsdpDtensorCheckpoint, m, source: str, weights: Dict[str, torch.Tensor]):
    """``((entries, optimizer_common) or None, note)``: Adam's per-parameter state of a Megatron-FSDP
    checkpoint (:meth:`FsdpDtensorCheckpoint.optimizer_states`) in megalm's names."""
    states = ckpt.optimizer_states(weights)
    if not states:
        return None, "the optimizer state was not imported (weights only): the checkpoint holds no Adam moments"
    params = sorted(p for p in checkpoint_shapes(m) if p != OUTPUT_LAYER or m.untie_embeddings_and_output_weights)
    entries, optimizer_common, note = optimizer_entries(
        states, lambda t: to_megalm_names(_parameters(t), m, source, buffers=False), params, ckpt.adam_step()
    )
    return (None if entries is None else (entries, optimizer_common)), note


def _parameters(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``tensors`` without the router's ``expert_bias`` buffers (a state of the weights, not of the optimizer)."""
    return {k: t for k, t in tensors.items() if not k.endswith(".expert_bias")}


def config_from_saved_args(args: dict, source: str, extra_args: List[str]) -> Tuple[MegalmConfig, List[str]]:
    """``(config, notes)`` from Megatron's saved ``args`` and the megalm flags (which must agree)."""
    parser = build_parser("megalm import", exit_on_error=False)
    explicit = _explicit_dests(parser, extra_args)
    try:
        given_vocab = config_from_args(parser.parse_args(extra_args)).model.vocab_size
    except ConfigError as e:
        raise ConversionError(f"cannot parse the megalm flags {extra_args}: {e}") from None
    given_vocab = given_vocab if "model.vocab_size" in explicit else None
    tok_vocab, tok_flags, tok_notes = _tokenizer(args, extra_args) if given_vocab is None else (None, [], [])
    try:
        vocab, vocab_source = true_vocab_size(args, given_vocab, tok_vocab)
    except ConversionError as e:
        raise ConversionError(f"{source}: {e}{''.join('; ' + n for n in tok_notes)}") from None
    fields, arg_notes = megalm_fields(args, source, vocab)
    if "model.seq_length" not in explicit:
        extra_args = extra_args + ["--seq-length", str(int(args["seq_length"]))]
    vocab_note = f"vocabulary {vocab} from {vocab_source} (the saved padded size was {args.get('padded_vocab_size')})"
    config = build_config(fields, extra_args + tok_flags, overridable=MOE_TRAINING_FIELDS)
    return config, [vocab_note] + tok_notes + arg_notes


def config_from_flags(extra_args: List[str], path: str) -> MegalmConfig:
    """The config from the megalm flags alone (``--ignore-saved-args``); the vocabulary from
    ``--vocab-size`` or the tokenizer flags."""
    from megalm.tokenizers.build import create_tokenizer

    parser = build_parser("megalm import", exit_on_error=False)
    try:
        cfg = config_from_args(parser.parse_args(extra_args))
        vocab = cfg.model.vocab_size
        if "model.vocab_size" not in _explicit_dests(parser, extra_args):
            d = cfg.data
            if not d.tokenizer_type:
                raise ConversionError(
                    f"{path}: with --ignore-saved-args give the model's megalm flags, and --vocab-size or the "
                    f"tokenizer flags"
                )
            vocab = create_tokenizer(d.tokenizer_type, d.tokenizer_model, None, d.vocab_file, d.merge_file).vocab_size
        cfg = validate_config(cfg)
    except ConfigError as e:
        raise ConversionError(f"the megalm flags {extra_args}: {e}") from None
    return with_vocab_size(cfg, vocab)


def config_notes_from_flags() -> List[str]:
    return [
        "architecture from the megalm flags given (common.pt not read): only tensor shapes were checked against "
        "them; RoPE base, norm epsilon and the GELU form (--openai-gelu for Megatron's default fused bias-GELU) "
        "are as given"
    ]


def import_from_megatron(
    load_dir: str,
    save_dir: str,
    extra_args: Sequence[str] = (),
    iteration: Optional[int] = None,
    out_iteration: int = 0,
    dtype: Optional[str] = None,
    use_saved_args: bool = True,
) -> ImportResult:
    """Write ``save_dir/iter_<out_iteration>/`` from the Megatron-LM checkpoint in ``load_dir``.

    ``extra_args``: megalm flags recorded in the config (the target TP/PP layout, ``--vocab-size``
    when neither the saved args nor a readable tokenizer give the true vocabulary, ...);
    architecture flags must agree with the saved args.  ``use_saved_args`` False (``torch_dist`` and
    ``fsdp_dtensor``, ``--ignore-saved-args``): ``common.pt`` (the ``args`` entry) is not opened and the
    architecture is ``extra_args`` alone, checked against the tensor shapes only.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    path = find_iteration_dir(load_dir, iteration)
    backend = backend_of(path)
    extra_args = list(extra_args)
    if backend == "torch_dist":
        ckpt = TorchDistCheckpoint(path, read_args=use_saved_args)
        args, tensors = ckpt.args, None
        source = ckpt.common_source
        notes = ["the optimizer state was not imported (weights only)"] if ckpt.optimizer_keys else []
    elif backend == FSDP_DTENSOR:
        ckpt = FsdpDtensorCheckpoint(path, read_args=use_saved_args)
        args, tensors, source = ckpt.args, ckpt.model_tensors(), ckpt.source
        notes = []
    elif backend == "legacy":
        if not use_saved_args:
            raise ConversionError(
                f"{path}: --ignore-saved-args applies to torch_dist checkpoints only (the legacy files hold the "
                f"weights in the same pickle as the args)"
            )
        args, tensors, notes = merge_legacy(path)
        source = path
    else:
        raise ConversionError(
            f"{path}: Megatron-LM sharded backend {backend!r} is not read (save with --ckpt-format torch_dist "
            f"or the legacy format)"
        )
    if args is None:
        cfg, notes = config_from_flags(extra_args, path), config_notes_from_flags() + notes
    else:
        cfg, config_notes = config_from_saved_args(args, source, extra_args)
        notes = config_notes + notes
    m = cfg.model
    if tensors is None:
        tensors = ckpt.layer_tensors(m.num_layers)
    out = to_megalm_names(tensors, m, source, "the saved args" if args is not None else "the megalm flags")
    if dtype:
        out = {k: v.to(DTYPES[dtype]) for k, v in out.items()}
    optimizer = None
    if backend == "torch_dist" and ckpt.optimizer_keys:
        optimizer, note = _optimizer_state(ckpt, m, source, os.path.basename(path), tensors)
        notes = [n for n in notes if "optimizer state was not imported" not in n] + [note]
    if backend == FSDP_DTENSOR:
        optimizer, note = _fsdp_dtensor_optimizer_state(ckpt, m, source, tensors)
        notes.append(note)
    stored = sorted({str(t.dtype).replace("torch.", "") for t in out.values()})
    main_weights = optimizer is not None and any(k.endswith(".main_param") for k in optimizer[0])
    if stored != ["float32"]:
        notes.append(
            f"weights imported in {', '.join(stored)}; the fp32 main copies in Megatron's optimizer state are "
            + ("imported as the optimizer's main weights" if main_weights else "not read")
        )
    megatron_iteration = os.path.basename(path)
    extra = {
        "converted_from": os.path.abspath(path),
        "megatron_format": backend,
        "megatron_checkpoint": megatron_iteration,
    }
    written = write_checkpoint(save_dir, out_iteration, out, cfg, extra, optimizer)
    return ImportResult(
        written,
        f"Megatron-LM {backend} {megatron_iteration}",
        cfg,
        len(out),
        sum(t.numel() for t in out.values()),
        notes,
    )

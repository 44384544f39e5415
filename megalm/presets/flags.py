"""A preset plus the launcher's overrides -> ``pretrain_gpt.py`` flags.

The scripts in ``scripts/`` let the environment override a preset's layout and schedule
(``TP=2 GLOBAL_BATCH_SIZE=64 scripts/pretrain_llama2_7b.sh``): :class:`Overrides` holds those
values (:meth:`Overrides.from_env` reads them; nothing here reads ``os.environ`` itself),
:func:`resolve` applies them (iterations from tokens, warm-up cut to fit a shrunk run) and
:func:`recipe_flags` gives the flags, in the order the scripts pass them: model, parallel
layout, batch, precision, optimizer and schedule.  No process groups and no torch here
(except to resolve ``PRECISION=auto``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from megalm.log import get_logger
from megalm.presets.spec import Layout, Preset, PresetError, Shape
from megalm.presets.table import PRESETS

logger = get_logger(__name__)

RECOMPUTE_CHOICES = ("none", "selective", "full")
PRECISION_CHOICES = ("bf16", "fp16", "fp32", "auto")


@dataclass(frozen=True)
class Overrides:
    """Launcher overrides of a preset (None / defaults: the preset's own); names as the env vars."""

    gpus_per_node: int | None = None
    nnodes: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    train_tokens: int | None = None
    train_iters: int | None = None
    lr_decay_iters: int | None = None
    lr_warmup_iters: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    vocab_size: int | None = None
    precision: str | None = None
    recompute: str | None = None
    recompute_num_layers: int = 1
    vp_layers: int | None = None
    sequence_parallel: bool = True
    dist_opt: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Overrides:
        """Read ``TP``, ``PP``, ``LR``, ... (upper-case field names); unset or empty: not overridden."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.name.upper(), "")
            if raw == "":
                continue
            if f.type == "bool":
                values[f.name] = raw == "1"
            elif "str" in f.type:
                values[f.name] = raw
            else:
                values[f.name] = _number(f.name.upper(), raw, float if "float" in f.type else int)
        return cls(**values)


def _number(name: str, raw: str, kind):
    try:
        return kind(raw)
    except ValueError:
        raise PresetError(f"{name} must be {'a number' if kind is float else 'an integer'}, got '{raw}'") from None


@dataclass(frozen=True)
class Launch:
    """A preset with every override applied: what one launch passes."""

    preset: Preset
    layout: Layout  # the preset's, overridden; precision resolved (never "auto")
    train_iters: int
    lr_decay_iters: int
    lr_warmup_iters: int
    lr: float
    min_lr: float
    vocab_size: int
    recompute_num_layers: int = 1
    vp_layers: int | None = None
    sequence_parallel: bool = True
    dist_opt: bool = True


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise PresetError(f"unknown preset '{name}'; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_precision(precision: str) -> str:
    """``auto`` -> bf16 on a GPU or a CPU with native bf16 instructions (else a bf16 matmul runs
    ~100x slower than fp32 on a CPU), fp32 otherwise."""
    if precision not in PRECISION_CHOICES:
        raise PresetError(f"PRECISION must be bf16, fp16, fp32 or auto, got '{precision}'")
    if precision != "auto":
        return precision
    import torch

    from megalm.flops import cpu_has_native_bf16

    resolved = "bf16" if torch.cuda.is_available() or cpu_has_native_bf16() else "fp32"
    logger.warning("PRECISION=auto: %s", resolved)
    return resolved


def _layout(preset: Preset, o: Overrides) -> Layout:
    lay = preset.layout
    recompute = o.recompute or lay.recompute
    if recompute not in RECOMPUTE_CHOICES:
        raise PresetError(f"RECOMPUTE must be none, selective or full, got '{recompute}'")

    def pick(mine, default):
        return default if mine is None else mine

    return dataclasses.replace(
        lay,
        gpus_per_node=pick(o.gpus_per_node, lay.gpus_per_node),
        nnodes=pick(o.nnodes, lay.nnodes),
        tp=pick(o.tp, lay.tp),
        pp=pick(o.pp, lay.pp),
        ep=None if lay.ep is None else pick(o.ep, lay.ep),
        micro_batch_size=pick(o.micro_batch_size, lay.micro_batch_size),
        global_batch_size=pick(o.global_batch_size, lay.global_batch_size),
        recompute=recompute,
        precision=resolve_precision(o.precision or lay.precision),
    )


def _schedule_iters(preset: Preset, o: Overrides, global_batch_size: int) -> tuple:
    """(train, decay, warm-up) iterations: from tokens where the preset counts tokens; warm-up
    is cut to a tenth of the decay when a short run leaves no room for it."""
    s = preset.schedule
    tokens_per_iteration = global_batch_size * preset.shape.seq_length
    if o.train_iters is not None:
        train = o.train_iters
    elif s.train_tokens is not None:
        train = (o.train_tokens or s.train_tokens) // tokens_per_iteration
    else:
        train = s.train_iters
    if train < 1:
        raise PresetError(f"TRAIN_ITERS must be >= 1, got {train}")
    num, den = s.decay_fraction
    decay = max(1, o.lr_decay_iters if o.lr_decay_iters is not None else train * num // den)
    if o.lr_warmup_iters is not None:
        warmup = o.lr_warmup_iters
    elif s.warmup_tokens is not None:
        warmup = s.warmup_tokens // tokens_per_iteration
    else:
        warmup = s.warmup_iters
    if warmup >= decay:
        warmup = decay // 10
    return train, decay, warmup


def resolve(preset: Preset, overrides: Overrides = Overrides()) -> Launch:
    layout = _layout(preset, overrides)
    train, decay, warmup = _schedule_iters(preset, overrides, layout.global_batch_size)
    s, o = preset.schedule, overrides
    return Launch(
        preset=preset,
        layout=layout,
        train_iters=train,
        lr_decay_iters=decay,
        lr_warmup_iters=warmup,
        lr=s.lr if o.lr is None else o.lr,
        min_lr=s.min_lr if o.min_lr is None else o.min_lr,
        vocab_size=preset.vocab_size if o.vocab_size is None else o.vocab_size,
        recompute_num_layers=o.recompute_num_layers,
        vp_layers=o.vp_layers,
        sequence_parallel=o.sequence_parallel,
        dist_opt=o.dist_opt,
    )


def _num(x) -> str:
    return repr(x) if isinstance(x, float) else str(x)


def _shape_flags(m: Shape) -> list[str]:
    flags = ["--num-layers", _num(m.num_layers), "--hidden-size", _num(m.hidden_size)]
    if m.ffn_hidden_size is not None:
        flags += ["--ffn-hidden-size", _num(m.ffn_hidden_size)]
    flags += ["--num-attention-heads", _num(m.num_attention_heads)]
    if m.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", _num(m.num_query_groups)]
    flags += [
        "--seq-length",
        _num(m.seq_length),
        "--max-position-embeddings",
        _num(m.max_position_embeddings or m.seq_length),
        "--position-embedding-type",
        m.position_embedding_type,
    ]
    if m.rotary_base is not None:
        flags += ["--rotary-base", _num(m.rotary_base)]
    flags += ["--normalization", m.normalization]
    if m.norm_epsilon is not None:
        flags += ["--norm-epsilon", _num(m.norm_epsilon)]
    flags += ["--swiglu"] * m.swiglu + ["--disable-bias-linear"] * (not m.add_bias_linear)
    flags += ["--untie-embeddings-and-output-weights"] * m.untie_embeddings_and_output_weights
    return flags + [
        "--hidden-dropout",
        _num(m.dropout),
        "--attention-dropout",
        _num(m.dropout),
        "--init-method-std",
        _num(m.init_method_std),
    ]


def model_flags(launch: Launch) -> list[str]:
    """Shape, then mixture of experts and its expert-parallel size."""
    flags, moe = _shape_flags(launch.preset.shape), launch.preset.moe
    if moe is None:
        return flags
    flags += [
        "--num-experts",
        _num(moe.num_experts),
        "--moe-ffn-hidden-size",
        _num(moe.moe_ffn_hidden_size),
        "--moe-router-topk",
        _num(moe.moe_router_topk),
    ]
    if moe.moe_router_load_balancing_type is not None:
        flags += ["--moe-router-load-balancing-type", moe.moe_router_load_balancing_type]
    flags += ["--moe-aux-loss-coeff", _num(moe.moe_aux_loss_coeff)]
    if moe.moe_z_loss_coeff is not None:
        flags += ["--moe-z-loss-coeff", _num(moe.moe_z_loss_coeff)]
    flags += ["--moe-router-dtype", moe.moe_router_dtype, "--moe-token-dispatcher-type", moe.moe_token_dispatcher_type]
    flags += ["--moe-grouped-gemm"] * moe.moe_grouped_gemm
    return flags + ["--expert-model-parallel-size", _num(launch.layout.ep)]


def parallel_flags(launch: Launch) -> list[str]:
    """TP / PP (+ sequence parallelism when TP > 1), interleaving, distributed optimizer, recompute."""
    lay = launch.layout
    flags = ["--tensor-model-parallel-size", _num(lay.tp), "--pipeline-model-parallel-size", _num(lay.pp)]
    flags += ["--sequence-parallel"] * (launch.sequence_parallel and lay.tp > 1)
    if launch.vp_layers is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", _num(launch.vp_layers)]
    if launch.dist_opt:
        flags += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    if lay.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif lay.recompute == "full":
        flags += [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            _num(launch.recompute_num_layers),
        ]
    return flags


def optimizer_flags(launch: Launch) -> list[str]:
    s = launch.preset.schedule
    flags = [
        "--optimizer",
        "adam",
        "--lr",
        _num(launch.lr),
        "--min-lr",
        _num(launch.min_lr),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        _num(launch.lr_warmup_iters),
        "--lr-decay-iters",
        _num(launch.lr_decay_iters),
        "--adam-beta1",
        _num(s.adam_beta1),
        "--adam-beta2",
        _num(s.adam_beta2),
    ]
    if s.adam_eps is not None:
        flags += ["--adam-eps", _num(s.adam_eps)]
    flags += ["--weight-decay", _num(s.weight_decay), "--clip-grad", _num(s.clip_grad)]
    flags += ["--exit-signal-handler"] * s.exit_signal_handler
    if s.distributed_timeout_minutes is not None:
        flags += ["--distributed-timeout-minutes", _num(s.distributed_timeout_minutes)]
    return flags


def recipe_flags(launch: Launch) -> list[str]:
    """Everything a preset decides, in the scripts' order (data, checkpoints and logging are the launcher's)."""
    lay = launch.layout
    batch = [
        "--micro-batch-size",
        _num(lay.micro_batch_size),
        "--global-batch-size",
        _num(lay.global_batch_size),
        "--train-iters",
        _num(launch.train_iters),
    ]
    precision = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[lay.precision]
    return model_flags(launch) + parallel_flags(launch) + batch + precision + optimizer_flags(launch)


def null_tokenizer_flags(launch: Launch) -> list[str]:
    """The vocabulary without a tokenizer file: NullTokenizer adds the end-of-document id after
    ``--vocab-size`` ids, so ``vocab_size - 1`` gives exactly ``vocab_size`` (GPT-2: 50256 + 1)."""
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", _num(launch.vocab_size - 1)]


def preset_flags(name: str, overrides: Overrides = Overrides()) -> list[str]:
    """The flags ``python3 tools/presets.py NAME`` prints and ``tools/estimate.py --preset NAME``
    uses: the recipe with the NullTokenizer vocabulary (what a script passes on mock data)."""
    launch = resolve(get_preset(name), overrides)
    return recipe_flags(launch) + null_tokenizer_flags(launch)

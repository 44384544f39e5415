"""Convert checkpoints between megalm and Hugging Face transformers (safetensors only); import Megatron-LM ones.

    # megalm -> HF (latest iteration unless --iteration; any TP/PP/EP layout it was saved with)
    python tools/checkpoint/convert.py --to hf --load-dir CKPT --save-dir HF_DIR [--dtype bfloat16] [--verify]

    # HF -> megalm, for a target layout (other pretrain_gpt.py flags are recorded in the config)
    python tools/checkpoint/convert.py --to megalm --load-dir HF_DIR --save-dir CKPT \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 [--expert-model-parallel-size 2] [--verify]

    # Megatron-LM --save directory (torch_dist or legacy mp_rank_XX) -> megalm, for a target layout
    python tools/checkpoint/convert.py --from megatron --load-dir MEGATRON_SAVE --save-dir CKPT \\
        [--iteration N] [--vocab-size V] [--tensor-model-parallel-size 2 ...]

``--from megatron`` reads the architecture from the checkpoint's own saved args (``common.pt`` or
``model_optim_rng.pt``, unpickled with ``torch.load(weights_only=True)`` and an exact allow-list of
inert classes: argparse.Namespace, Megatron's enums as stand-ins, numpy's RNG arrays; anything else
is refused naming the file and nothing from it runs) and checks every tensor's shape against it;
megalm flags given must agree with it.  When a newer Megatron stores a class outside that list in
``common.pt`` (torch_dist), ``--ignore-saved-args`` skips the file: the architecture is then the
megalm flags given, checked against the tensor shapes only.  The true vocabulary comes from
``--vocab-size``, the saved tokenizer's files or the saved ``vocab_size`` (+ 1 for NullTokenizer);
the padded rows are dropped.  Megatron's default fused bias-GELU is the tanh approximation: such
models are recorded with ``--openai-gelu``.  Weights as saved (bf16 for a ``--bf16`` run); a
``torch_dist`` checkpoint's Adam state in model space (moments, fp32 main weights) is imported too, so
``--load`` resumes it; other optimizer layouts are not (a note says so).  Mixture-of-experts models
(router and expert bias, experts, shared expert; legacy files merged over EP) import.  Multi-latent
attention, interleaved or scaled RoPE, ``zarr`` and virtual-pipeline legacy checkpoints are refused.

Llama-style models map to ``LlamaForCausalLM``, GPT-2-style ones to ``GPT2LMHeadModel``,
Mixtral-style mixture-of-experts models (experts in every layer, softmax top-k router, SwiGLU
experts, no biases, shared experts or token dropping) to ``MixtralForCausalLM``; anything else
(including other MoE families) is refused with the reason.  ``--verify`` (needs
transformers) loads both models and prints the largest logit difference and the KL
divergence on a few random sequences; it exits 1 when they disagree beyond
``--verify-tolerance``.  Train from an imported checkpoint with ``--load CKPT --finetune``.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--to", choices=["hf", "megalm"], help="Direction of the conversion (megalm with --from).")
    parser.add_argument(
        "--from",
        dest="source",
        choices=["megatron"],
        default=None,
        help="Import a Megatron-LM checkpoint (torch_dist or legacy) into megalm.",
    )
    parser.add_argument(
        "--load-dir", required=True, help="megalm checkpoint root (--to hf) or HF directory (--to megalm)."
    )
    parser.add_argument(
        "--save-dir", required=True, help="HF directory (--to hf) or megalm checkpoint root (--to megalm)."
    )
    parser.add_argument(
        "--iteration",
        type=int,
        default=None,
        help="--to hf and --from megatron: the iteration to read (default: latest); "
        "--to megalm: the iteration to write (default 0).",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="Weight dtype written (default: --to hf the training dtype, --to megalm as stored).",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="--to hf: largest safetensors shard (default 5GB).")
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="--to hf: tokenizer file/directory to copy when the path in the checkpoint's config moved; "
        "--to megalm: recorded in the config (with --tokenizer-type).",
    )
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json, as --tokenizer-model.")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges file, as --tokenizer-model.")
    parser.add_argument(
        "--ignore-saved-args",
        action="store_true",
        help="--from megatron, torch_dist only: do not open common.pt; the architecture is the megalm flags "
        "given (--num-layers, --hidden-size, ..., --vocab-size), checked against the tensor shapes only.",
    )
    parser.add_argument("--verify", action="store_true", help="Compare both models' logits (needs transformers).")
    parser.add_argument(
        "--verify-tolerance",
        type=float,
        default=1e-3,
        help="Largest acceptable absolute logit difference for --verify (default 1e-3).",
    )
    return parser


def _verify(megalm_dir, hf_dir, iteration, round_to, tolerance) -> int:
    from megalm.conversion.verify import compare_logits

    r = compare_logits(megalm_dir, hf_dir, iteration=iteration, round_to=round_to)
    ok = r["max_abs_diff"] <= tolerance
    print(
        f"[convert] verify: {r['tokens']} tokens | max |logit diff| {r['max_abs_diff']:.3e} | KL mean "
        f"{r['mean_kl']:.3e} max {r['max_kl']:.3e} | {'OK' if ok else f'FAILED (tolerance {tolerance:g})'}"
    )
    return 0 if ok else 1


def _from_megatron(args, rest) -> int:
    from megalm.conversion.megatron import import_from_megatron

    if args.verify:
        print("[convert] error: --verify compares with transformers, not with --from megatron", file=sys.stderr)
        return 2
    for flag, value in (
        ("--tokenizer-model", args.tokenizer_model),
        ("--vocab-file", args.vocab_file),
        ("--merge-file", args.merge_file),
    ):
        if value is not None:
            rest += [flag, value]
    r = import_from_megatron(
        args.load_dir,
        args.save_dir,
        extra_args=rest,
        iteration=args.iteration,
        dtype=args.dtype,
        use_saved_args=not args.ignore_saved_args,
    )
    p = r.config.parallel
    print(
        f"[convert] {r.architecture} -> {r.path}: {r.num_tensors} tensors, {r.num_parameters:,} parameters; "
        f"layout TP {p.tensor_model_parallel_size} PP {p.pipeline_model_parallel_size} recorded; "
        f"train with --load {args.save_dir} --finetune"
    )
    for note in r.notes:
        print(f"[convert] {note}")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    from megalm.conversion.hf_files import DTYPES, parse_size
    from megalm.errors import MegalmError  # CheckpointError, ConversionError, ... derive from it

    if args.source == "megatron":
        if args.to == "hf":
            parser.error("--from megatron writes a megalm checkpoint (--to megalm or no --to)")
        args.to = "megalm"
    elif args.to is None:
        parser.error("give --to hf, --to megalm or --from megatron")
    elif args.ignore_saved_args:
        parser.error("--ignore-saved-args applies to --from megatron")
    try:
        if args.source == "megatron":
            return _from_megatron(args, rest)
        if args.to == "hf":
            if rest:
                parser.error(f"unrecognized arguments for --to hf: {' '.join(rest)}")
            from megalm.conversion.export_hf import export_to_hf

            r = export_to_hf(
                args.load_dir,
                args.save_dir,
                iteration=args.iteration,
                dtype=args.dtype,
                max_shard_bytes=parse_size(args.max_shard_size),
                tokenizer_model=args.tokenizer_model,
                vocab_file=args.vocab_file,
                merge_file=args.merge_file,
            )
            print(
                f"[convert] iteration {r.iteration} -> {r.architecture} in {r.save_dir}: {r.num_tensors} tensors, "
                f"{r.total_bytes / 2**20:.1f} MiB {r.dtype} in {', '.join(r.files)}"
            )
            for note in r.notes:
                print(f"[convert] {note}")
            if args.verify:
                return _verify(args.load_dir, args.save_dir, r.iteration, DTYPES[r.dtype], args.verify_tolerance)
            return 0
        from megalm.conversion.import_hf import import_from_hf

        # The tokenizer file flags are also pretrain_gpt.py flags: pass them on to the config.
        for flag, value in (
            ("--tokenizer-model", args.tokenizer_model),
            ("--vocab-file", args.vocab_file),
            ("--merge-file", args.merge_file),
        ):
            if value is not None:
                rest += [flag, value]
        r = import_from_hf(
            args.load_dir, args.save_dir, extra_args=rest, iteration=args.iteration or 0, dtype=args.dtype
        )
        p = r.config.parallel
        ep = f" EP {p.expert_model_parallel_size}" if r.config.model.num_experts else ""
        print(
            f"[convert] {r.architecture} -> {r.path}: {r.num_tensors} tensors, {r.num_parameters:,} parameters; "
            f"layout TP {p.tensor_model_parallel_size} PP {p.pipeline_model_parallel_size}{ep} recorded; "
            f"train with --load {args.save_dir} --finetune"
        )
        for note in r.notes:
            print(f"[convert] {note}")
        if args.verify:
            return _verify(args.save_dir, args.load_dir, args.iteration or 0, None, args.verify_tolerance)
        return 0
    except MegalmError as e:
        print(f"[convert] error: {e}", file=sys.stderr)
        return 2

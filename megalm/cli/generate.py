"""Generate text from a megalm checkpoint, in one process or on tensor/pipeline-parallel ranks.

    python tools/generate.py --load CKPT --prompt "def main(" --max-new-tokens 64            # greedy
    python tools/generate.py --load CKPT --prompt-file prompts.txt --max-new-tokens 64 \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1234 --output-json out.json
    torchrun --nproc-per-node 4 tools/generate.py --load CKPT --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt "def main(" --max-new-tokens 64

The checkpoint (latest iteration unless --iteration; saved under any TP/PP/DP layout) is loaded
into ONE process as a TP 1 / PP 1 model, or, under torchrun with TP x PP processes
(--tensor-model-parallel-size, --pipeline-model-parallel-size), into that layout: each rank
holds its slice of the model and its KV cache, hidden states flow through the pipeline stages,
the last stage's TP rank 0 chooses every token and broadcasts it to all ranks, so the output is
the single-process output, token for token.  A multiple of TP x PP processes makes data-parallel
replicas, replica r generating prompts r, r + DP, ...  Rank 0 prints and writes --output-json.

The tokenizer is the one in the checkpoint's saved config unless --tokenizer-type /
--tokenizer-model are given.  Prompts come from repeatable --prompt flags and then --prompt-file
(one prompt per line, blank lines skipped) and are generated --batch-size at a time (prompts of
similar token counts together), one forward per step for the batch; a prompt's tokens do not
depend on the batch.  --temperature 0 (the default) is greedy; otherwise tokens are sampled
after top-k / top-p filtering, prompt i (0-based, in the order above) from its own
torch.Generator seeded with --seed + i (same seed, same output, under any batch size and
layout).  Generation stops after --max-new-tokens tokens or at the tokenizer's EOD token (kept
in the ids, not in the text).  A KV cache makes each new token cost one position.
--output-json writes a list with, per prompt: prompt, prompt_ids, generated_ids, text, stopped_at_eod.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

from megalm.inference.generation import GenerationError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--load", required=True, help="megalm checkpoint root (saved under any layout).")
    p.add_argument("--iteration", type=int, default=None, help="Iteration to load (default: latest).")
    p.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    p.add_argument("--prompt-file", default=None, help="A file with one prompt per line.")
    p.add_argument("--max-new-tokens", type=int, required=True, help="Most tokens to generate per prompt.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample.")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1.0: off).")
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="Sampling seed: prompt i draws from a generator seeded with seed + i (0-based, --prompt flags first).",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="Prompts generated together, one forward per step (default 8)."
    )
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor-parallel ranks (launch TP x PP processes with torchrun).",
    )
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages (launch TP x PP processes with torchrun).",
    )
    p.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Only 1: generation does not split sequences over ranks (a checkpoint trained at any "
        "--context-parallel-size loads; checkpoints do not depend on it).",
    )
    p.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Timeout of every collective.")
    p.add_argument("--no-stop-at-eod", action="store_true", help="Do not stop at the EOD token.")
    p.add_argument("--no-kv-cache", action="store_true", help="Re-run the whole sequence each step (slow; debugging).")
    p.add_argument("--tokenizer-type", default=None, help="Override the checkpoint's tokenizer type.")
    p.add_argument("--tokenizer-model", default=None, help="Override the checkpoint's tokenizer model file.")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only: ids 0..V-1.")
    p.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: override the checkpoint's vocab.json.")
    p.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: override the checkpoint's merges file.")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="Dtype the model runs in (default float32).",
    )
    p.add_argument("--output-json", default=None, help="Write the prompts and generations as JSON here.")
    return p


def read_prompts(args) -> List[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    return prompts


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def setup_layout(args):
    """Check the layout against the world; initialize torch.distributed and megalm.parallel_state for
    TP x PP > 1.  Returns whether this call created (parallel state, process group), to tear down after."""
    from datetime import timedelta

    import torch.distributed as dist

    from megalm import parallel_state
    from megalm.device import initialize_distributed

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.context_parallel_size != 1:
        raise GenerationError(
            f"--context-parallel-size {args.context_parallel_size}: generation does not support context "
            f"parallelism; use 1 (the checkpoint loads whatever CP size trained it)"
        )
    if tp < 1 or pp < 1:
        raise GenerationError(
            f"--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1, got {tp} and {pp}"
        )
    world = _world_size()
    if world % (tp * pp):
        raise GenerationError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs {tp * pp} "
            f"processes (or a multiple: data-parallel replicas), this run has {world} "
            f"(launch with torchrun --nproc-per-node {tp * pp})"
        )
    if world == 1:
        return False, False
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    created_group = not dist.is_initialized()
    initialize_distributed(timeout=timeout)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        ) != (tp, pp):
            raise GenerationError("megalm.parallel_state is already initialized with another layout")
        return False, created_group
    parallel_state.initialize_model_parallel(tp, pp, timeout=timeout)
    return True, created_group


def is_output_rank() -> bool:
    """Global rank 0 (or a single process) prints and writes --output-json."""
    import torch.distributed as dist

    return (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0


def run(args) -> List[dict]:
    import torch

    from megalm import parallel_state
    from megalm.device import get_device
    from megalm.inference import SamplingParams, generate_batch, load_model, load_model_parallel, tokenizer_for

    prompts = read_prompts(args)
    if not prompts:
        raise GenerationError("no prompts: pass --prompt TEXT and/or --prompt-file FILE")
    if args.max_new_tokens < 0:
        raise GenerationError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise GenerationError(f"--batch-size must be >= 1, got {args.batch_size}")
    params = SamplingParams(args.temperature, args.top_k, args.top_p).validate()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    created, created_group = setup_layout(args)
    try:
        device = get_device()
        if parallel_state.model_parallel_is_initialized() and _world_size() > 1:
            groups = parallel_state.get_process_groups()  # the tool builds the layout and passes its groups
            model, cfg, reader = load_model_parallel(args.load, args.iteration, dtype=dtype, groups=groups)
        else:
            model, cfg, reader = load_model(args.load, args.iteration, dtype=dtype)
            model = model.to(device)
        tokenizer = tokenizer_for(
            cfg, args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file, args.merge_file
        )
        eod = None if args.no_stop_at_eod else tokenizer.eod
        ids = [tokenizer.tokenize(prompt) for prompt in prompts]
        for prompt, prompt_ids in zip(prompts, ids):
            if not prompt_ids:
                raise GenerationError(f"the prompt {prompt!r} is empty (no tokens)")
        # Data-parallel replicas (world > TP x PP) take every dp-th prompt; seeds follow the prompt's index.
        dp, replica = 1, 0
        if parallel_state.model_parallel_is_initialized():
            dp, replica = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        # Batches of similar lengths: rows advance in lockstep, a longer prompt's tail is fed one token per step.
        mine = sorted(range(replica, len(prompts), dp), key=lambda i: len(ids[i]))
        by_index = {}
        for start in range(0, len(mine), args.batch_size):
            rows = mine[start : start + args.batch_size]
            generators = [torch.Generator(device=device).manual_seed(args.seed + i) for i in rows]
            outs = generate_batch(
                model,
                [ids[i] for i in rows],
                args.max_new_tokens,
                params,
                eod=eod,
                generators=generators,
                use_cache=not args.no_kv_cache,
            )
            for i, out in zip(rows, outs):
                text_ids = out.generated_ids[:-1] if out.stopped_at_eod else out.generated_ids
                by_index[i] = {
                    "prompt": prompts[i],
                    "prompt_ids": out.prompt_ids,
                    "generated_ids": out.generated_ids,
                    "text": tokenizer.detokenize(text_ids) if text_ids else "",
                    "stopped_at_eod": out.stopped_at_eod,
                }
        if dp > 1:
            import torch.distributed as dist

            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, by_index)
            for part in gathered:
                by_index.update(part)
        results = [by_index[i] for i in range(len(prompts))]
        return results
    finally:
        if created:
            parallel_state.destroy_model_parallel()
        if created_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megalm.errors import MegalmError  # CheckpointError, ConversionError, ... derive from it

    try:
        results = run(args)
    except (ValueError, OSError, MegalmError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not is_output_rank():
        return 0
    for r in results:
        print(
            f"--- prompt: {r['prompt']!r}\n--- generated ({len(r['generated_ids'])} tokens"
            f"{', stopped at EOD' if r['stopped_at_eod'] else ''}):\n{r['text']}"
        )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, ensure_ascii=False)
    return 0

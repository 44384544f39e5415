#!/usr/bin/env python
"""Generate text from a megalm checkpoint.

    python tools/generate.py --load CKPT --prompt "def main(" --max-new-tokens 64            # greedy
    python tools/generate.py --load CKPT --prompt-file prompts.txt --max-new-tokens 64 \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --seed 1234 --output-json out.json

The checkpoint (latest iteration unless --iteration; saved under any TP/PP/DP layout) is loaded
into ONE process as a TP 1 / PP 1 model; multi-rank (tensor/pipeline parallel) generation is
not supported yet, so the model must fit on one device.  The tokenizer is the one in the
checkpoint's saved config unless --tokenizer-type / --tokenizer-model are given.  Prompts come
from repeatable --prompt flags and/or --prompt-file (one prompt per line, blank lines skipped)
and are generated one at a time.  --temperature 0 (the default) is greedy; otherwise tokens are
sampled after top-k / top-p filtering from a torch.Generator seeded with --seed (same seed,
same output).  Generation stops after --max-new-tokens tokens or at the tokenizer's EOD token
(kept in the ids, not in the text).  A KV cache makes each new token cost one position.
--output-json writes a list with, per prompt: prompt, prompt_ids, generated_ids, text.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)))

import argparse  # noqa: E402
import json  # noqa: E402
from typing import List  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--load", required=True, help="megalm checkpoint root (single-process load of any saved layout; "
                                                 "multi-rank generation is not supported yet).")
    p.add_argument("--iteration", type=int, default=None, help="Iteration to load (default: latest).")
    p.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    p.add_argument("--prompt-file", default=None, help="A file with one prompt per line.")
    p.add_argument("--max-new-tokens", type=int, required=True, help="Most tokens to generate per prompt.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample.")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (1.0: off).")
    p.add_argument("--seed", type=int, default=1234, help="Seed of the sampling generator.")
    p.add_argument("--no-stop-at-eod", action="store_true", help="Do not stop at the EOD token.")
    p.add_argument("--no-kv-cache", action="store_true", help="Re-run the whole sequence each step (slow; debugging).")
    p.add_argument("--tokenizer-type", default=None, help="Override the checkpoint's tokenizer type.")
    p.add_argument("--tokenizer-model", default=None, help="Override the checkpoint's tokenizer model file.")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only: ids 0..V-1.")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="Dtype the model runs in (default float32).")
    p.add_argument("--output-json", default=None, help="Write the prompts and generations as JSON here.")
    return p


def read_prompts(args) -> List[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    return prompts


def run(args) -> List[dict]:
    import torch

    from megalm.device import get_device
    from megalm.inference import SamplingParams, generate, load_model, tokenizer_for

    prompts = read_prompts(args)
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT and/or --prompt-file FILE")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    params = SamplingParams(args.temperature, args.top_k, args.top_p).validate()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model, cfg, reader = load_model(args.load, args.iteration, dtype=dtype)
    device = get_device()
    model = model.to(device)
    tokenizer = tokenizer_for(cfg, args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    eod = None if args.no_stop_at_eod else tokenizer.eod
    results = []
    for prompt in prompts:
        ids = tokenizer.tokenize(prompt)
        out = generate(model, ids, args.max_new_tokens, params, eod=eod, generator=generator,
                       use_cache=not args.no_kv_cache)
        text_ids = out.generated_ids[:-1] if out.stopped_at_eod else out.generated_ids
        results.append({"prompt": prompt, "prompt_ids": out.prompt_ids, "generated_ids": out.generated_ids,
                        "text": tokenizer.detokenize(text_ids) if text_ids else "",
                        "stopped_at_eod": out.stopped_at_eod})
    return results


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megalm.checkpointing import CheckpointError
    from megalm.conversion.errors import ConversionError

    try:
        results = run(args)
    except (ValueError, OSError, CheckpointError, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        print(f"--- prompt: {r['prompt']!r}\n--- generated ({len(r['generated_ids'])} tokens"
              f"{', stopped at EOD' if r['stopped_at_eod'] else ''}):\n{r['text']}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""No bare ``ValueError`` / ``RuntimeError`` / ``KeyError`` raised in megalm/ except the internal
invariants listed here (read with ``ast``; nothing is imported).

What a user can trigger (a flag, a file, a corpus, a checkpoint, a tool argument) raises a
:class:`megalm.errors.MegalmError` subclass naming it (``ConfigError``, ``DataError``, ``TokenizerError``,
``CheckpointError``, ``GenerationError``, ``LayoutError``, ``LossScaleError``, ...; each also derives from
the builtin it replaced, so ``except ValueError`` still catches it).  What only a programming error can
reach (a component called against its contract, after the config was validated) may stay a bare builtin:
:data:`ALLOWED` holds, per file, how many and why.  A new bare raise fails this test: make it a
MegalmError subclass, or, if no input can reach it, add it here with the reason.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARE = ("ValueError", "RuntimeError", "KeyError")

# file -> (number of bare raises, why no user input reaches them)
ALLOWED: Dict[str, Tuple[int, str]] = {
    "megalm/checkpoint/stateful.py": (2, "state names are registered by the code that builds each component"),
    "megalm/checkpoint/dcp_io.py": (1, "load targets are the model's own tensors (contiguous by construction)"),
    "megalm/config/cli.py": (1, "an argparse type function: argparse turns its ValueError into a usage error"),
    "megalm/conversion/hf_files.py": (2, "writer API: shard size is a constant, names come from the mapping"),
    "megalm/training/rebalance.py": (1, "a global batch has >= one micro-batch per replica (validated sizes)"),
    "megalm/data/blended_dataset.py": (1, "datasets and weights come from parse_blend, which checked them"),
    "megalm/data/helpers.py": (1, "weights count bounded by parse_blend's prefixes"),
    "megalm/data/indexed_dataset.py": (6, "builder/reader API contract (dtype, lengths, slices, order of calls)"),
    "megalm/data/loaders.py": (2, "--dataloader-type is an argparse choice; shares need 'single' (validated)"),
    "megalm/data/samplers.py": (6, "sampler arguments come from the validated config and the trainer's state"),
    "megalm/distributed/finalize_model_grads.py": (3, "tied-parameter bookkeeping of the model builder"),
    "megalm/flops.py": (1, "called after the tokenizer set the vocabulary"),
    "megalm/inference/generation.py": (3, "API: one generator per prompt, eval mode, parallel state set up"),
    "megalm/inference/kv_cache.py": (1, "the cache is sized by generate() for prompt + new tokens"),
    "megalm/inference/sampling.py": (1, "API: one generator per row"),
    "megalm/models/gpt.py": (3, "model API: vocabulary set by the trainer, pipeline input set by the schedule"),
    "megalm/models/layer_split.py": (3, "stage indices come from parallel_state"),
    "megalm/parallel_state.py": (3, "initialization order of the process groups"),
    "megalm/param_layout.py": (3, "shard bookkeeping of tensors the code describes itself"),
    "megalm/pipeline_parallel/p2p_communication.py": (3, "tensor shapes agreed by the schedule"),
    "megalm/pipeline_parallel/schedule_1f1b.py": (2, "schedule choice and microbatch count from the validated config"),
    "megalm/pipeline_parallel/schedule_interleaved.py": (3, "virtual stages validated by the config"),
    "megalm/pipeline_parallel/schedules.py": (1, "schedule choice from the validated config"),
    "megalm/pipeline_parallel/steps.py": (2, "iterator per chunk and microbatch order of the schedule"),
    "megalm/tensor_parallel/cross_entropy.py": (2, "autograd contract (backward once) and shapes from the model"),
    "megalm/tensor_parallel/initialization.py": (4, "init rules registered by the layers themselves"),
    "megalm/tensor_parallel/layers.py": (3, "layer construction contract"),
    "megalm/tensor_parallel/linear_cross_entropy.py": (5, "autograd contract and shapes from the model"),
    "megalm/tensor_parallel/random.py": (3, "RNG streams registered once by the model"),
    "megalm/tensor_parallel/utils.py": (3, "sizes validated by the config before the split"),
    "megalm/timers.py": (3, "--timing-log-level / --timing-log-option are argparse choices; timer names are code's"),
    "megalm/training/step.py": (1, "the forward step's loss_func contract (scalar or [sum, count])"),
    "megalm/transformer/blocked_attention.py": (2, "shapes from the attention module"),
    "megalm/transformer/moe/experts.py": (1, "token counts from the router"),
    "megalm/transformer/rope.py": (1, "rotary dimension validated by the config (ModelConfig.validate)"),
    "megalm/transformer/te_layers.py": (1, "Transformer Engine parameter names known to the mapping"),
}


def bare_raises(source: str) -> List[Tuple[int, str]]:
    """``(line, name)`` of every ``raise ValueError/RuntimeError/KeyError[(...)]``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BARE:
                out.append((node.lineno, exc.id))
    return out


def test_bare_raises_are_the_reviewed_internal_invariants():
    found: Dict[str, List[Tuple[int, str]]] = {}
    for folder, _, files in os.walk(os.path.join(REPO, "megalm")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    raises = bare_raises(f.read())
                if raises:
                    found[os.path.relpath(path, REPO)] = raises
    extra = {p: r for p, r in found.items() if len(r) > ALLOWED.get(p, (0, ""))[0]}
    assert not extra, f"bare raises a user may reach: make them MegalmError subclasses (or review them): {extra}"
    stale = {p: n for p, (n, _) in ALLOWED.items() if len(found.get(p, [])) < n}
    assert not stale, f"ALLOWED counts more raises than the files hold (lower them): {stale}"


def test_the_scan_finds_bare_raises():
    src = "raise ValueError('x')\nraise KeyError\nraise MegalmError('y')\ntry:\n    pass\nexcept E:\n    raise\n"
    assert bare_raises(src) == [(1, "ValueError"), (2, "KeyError")]

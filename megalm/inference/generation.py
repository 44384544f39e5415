"""Autoregressive generation with a GPTModel: one process, or tensor/pipeline-parallel ranks.

:func:`generate_batch` generates after several prompts at once, one forward per step for the
whole batch; :func:`generate` is the batch of one.  The prompts' common prefix (the shortest
prompt's length) fills a :class:`KVCache` in one forward, then every step feeds one token per row
(``use_cache=False`` re-runs the whole sequence each step instead; it exists to check the cache).
Rows advance in lockstep over positions (Megatron's scheme): while a longer prompt still has
prompt tokens at the current position, the row is fed its own next prompt token and the model's
choice is discarded, so no padding token ever enters the keys/values or shifts a position, and
each row's tokens are those of generating its prompt alone.  Each row stops after
``max_new_tokens`` tokens or at ``eod`` (the EOD token is kept in the returned ids, as
``transformers`` does); the batch stops when every row has.  With learned absolute positions a
prompt plus ``max_new_tokens`` cannot exceed ``max_position_embeddings``.

Model parallel: ``model`` is this rank's piece of the model (:func:`load_model_parallel`): every
rank of the model-parallel group (TP x PP) calls :func:`generate_batch` with the same prompts.
Hidden states travel forward between pipeline stages with
:class:`megalm.pipeline_parallel.p2p_communication.P2PCommunicator`; the last stage gathers
its vocab-parallel logits of each row's last position on its TP rank 0 (padded vocabulary
trimmed), which chooses the tokens (it alone uses the generators) and broadcasts them to the
whole model-parallel group, so the first stage can embed them and every rank knows when a row
is done.  Each rank keeps the KV cache of its own layers and heads.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megalm.errors import MegalmError
from megalm.fusions import EAGER
from megalm.inference.kv_cache import KVCache
from megalm.inference.sampling import SamplingParams, sample_next
from megalm.parallel_state import ProcessGroups, group_rank, group_size

Generators = Union[None, torch.Generator, Sequence[Optional[torch.Generator]]]


class GenerationError(MegalmError, ValueError):
    """A generation request that cannot run: a prompt, a flag or a checkpoint that does not fit."""


@dataclass
class GenerationOutput:
    prompt_ids: List[int]
    generated_ids: List[int]
    stopped_at_eod: bool = False
    # [V] fp32 per step, when asked for; filled on the rank that samples (last stage, TP rank 0) only.
    step_logits: List[torch.Tensor] = field(default_factory=list)


def max_sequence_length(model) -> Optional[int]:
    """The most positions the model can embed (learned absolute positions), else None."""
    m = model.cfg.model
    return m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None


class _StageRunner:
    """Runs this rank's piece of the model for one step and shares the chosen tokens.

    A model with ``pre_process`` and ``post_process`` and TP 1 is the whole model: no
    communication.  Otherwise the process groups are the model's (``model.process_groups``).
    """

    def __init__(self, model):
        param = next(model.parameters())
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        self.first = bool(getattr(model, "pre_process", True))
        self.last = bool(getattr(model, "post_process", True))
        self.tp = int(getattr(model, "tp_size", 1))
        self.distributed = self.tp > 1 or not (self.first and self.last)
        self.is_sampler = True
        if not self.distributed:
            return
        groups = getattr(model, "process_groups", None)
        if not dist.is_initialized() or groups is None or groups.mp is None:
            raise RuntimeError(
                "a tensor/pipeline-parallel model needs torch.distributed and its process groups "
                "(see megalm.inference.load_model_parallel)"
            )
        if group_size(groups.cp) > 1:
            raise GenerationError("generation does not support context parallelism")
        self.groups = groups
        self.tp_rank = group_rank(groups.tp)
        self.is_sampler = self.last and self.tp_rank == 0
        self.group = groups.mp
        # The one sampling rank of this model-parallel group, as a global rank (every rank learns it).
        who = torch.tensor([dist.get_rank() if self.is_sampler else -1], dtype=torch.long, device=self.device)
        dist.all_reduce(who, op=dist.ReduceOp.MAX, group=self.group)
        self.sampler_rank = int(who.item())

    def _communicator(self, tokens: torch.Tensor):
        from megalm.pipeline_parallel.p2p_communication import P2PCommunicator

        b, s = tokens.shape
        return P2PCommunicator((s, b, self.model.cfg.model.hidden_size), self.dtype, groups=self.groups)

    def _gather_vocab(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """``[b, V/tp]`` on every TP rank of the last stage -> ``[b, V_padded]`` on TP rank 0, else None."""
        group = self.groups.tp
        dst = dist.get_global_rank(group, 0)
        local = logits.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)] if self.tp_rank == 0 else None
        dist.gather(local, parts, dst=dst, group=group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def last_logits(self, tokens: torch.Tensor, cache: Optional[KVCache], offset: int) -> Optional[torch.Tensor]:
        """Logits ``[b, V]`` (fp32, fp64 for an fp64 model; vocabulary padding dropped) of the last of
        ``tokens`` ``[b, s]`` (positions ``offset..``) on the sampling rank; None on the others."""
        model = self.model
        position_ids = None
        if cache is not None:
            position_ids = torch.arange(offset, offset + tokens.shape[1], device=self.device).unsqueeze(0)
        if not self.first:
            model.set_input_tensor(self._communicator(tokens).recv_forward(requires_grad=False))
        out = model(tokens if self.first else None, position_ids=position_ids, inference_cache=cache)
        if not self.first:
            model.set_input_tensor(None)
        if not self.last:
            self._communicator(tokens).send_forward(out)
            return None
        logits = out[:, -1, :]  # [b, V/tp]
        if self.tp > 1:
            logits = self._gather_vocab(logits)
            if logits is None:
                return None
        logits = logits[:, : model.vocab_size]  # drop vocabulary padding
        return logits if logits.dtype == torch.float64 else logits.float()

    def share(self, chosen: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        """The sampling rank's ``[b]`` token ids, on every rank of the model-parallel group."""
        if not self.distributed:
            return chosen
        buffer = chosen.contiguous() if self.is_sampler else torch.empty(batch, dtype=torch.long, device=self.device)
        dist.broadcast(buffer, src=self.sampler_rank, group=self.group)
        return buffer


def _row_generators(generators: Generators, batch: int):
    if generators is None or isinstance(generators, torch.Generator):
        return generators
    generators = list(generators)
    if len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} prompts (give one per prompt)")
    return generators


@torch.no_grad()
def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: Optional[SamplingParams] = None,
    eod: Optional[int] = None,
    generators: Generators = None,
    use_cache: bool = True,
    return_logits: bool = False,
) -> List[GenerationOutput]:
    """Generate up to ``max_new_tokens`` tokens after each of ``prompts`` (model in eval mode).

    ``generators``: one per prompt (row ``i`` samples from ``generators[i]`` only, so its tokens
    equal generating that prompt alone with that generator), or one shared by all rows, or None
    (torch's default generator).  Under model parallelism only the sampling rank draws from them.
    """
    params = (params or SamplingParams()).validate()
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise GenerationError("no prompts")
    for i, p in enumerate(prompts):
        if not p:
            raise GenerationError(
                "the prompt is empty (no tokens)" if len(prompts) == 1 else f"prompt {i} is empty (no tokens)"
            )
    if model.training:
        raise ValueError("generate() needs the model in eval mode (dropout off): call model.eval()")
    limit = max_sequence_length(model)
    for p in prompts:
        if limit is not None and len(p) + max_new_tokens > limit:
            raise GenerationError(
                f"prompt ({len(p)} tokens) + --max-new-tokens {max_new_tokens} = "
                f"{len(p) + max_new_tokens} exceeds the model's {limit} learned positions"
            )
    outs = [GenerationOutput(p, []) for p in prompts]
    if max_new_tokens <= 0:
        return outs
    batch = len(prompts)
    generators = _row_generators(generators, batch)
    runner = _StageRunner(model)
    lengths = [len(p) for p in prompts]
    total = max(lengths) + max_new_tokens
    # Right-padded token buffer; the padding is never fed: see the module docstring.
    tokens = torch.zeros((batch, total), dtype=torch.long, device=runner.device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    cache = KVCache(total) if use_cache else None
    pos = min(lengths)  # the position whose token is chosen next
    logits = runner.last_logits(tokens[:, :pos], cache, 0)
    done = [False] * batch
    while True:
        active = [i for i in range(batch) if not done[i] and pos >= lengths[i]]  # rows generating now
        chosen = None
        if runner.is_sampler:
            chosen = tokens[:, pos].clone()  # prompt tokens where a prompt goes on
            if active:
                rows = torch.tensor(active, dtype=torch.long, device=chosen.device)
                row_generators = (
                    generators
                    if generators is None or isinstance(generators, torch.Generator)
                    else [generators[i] for i in active]
                )
                chosen[rows] = sample_next(logits[rows], params, row_generators).to(chosen.device)
                if return_logits:
                    for i in active:
                        outs[i].step_logits.append(logits[i].cpu())
        chosen = runner.share(chosen, batch)
        for i, token_id in zip(active, chosen[active].tolist() if active else []):
            out = outs[i]
            out.generated_ids.append(int(token_id))
            if eod is not None and token_id == eod:
                out.stopped_at_eod = done[i] = True
            elif len(out.generated_ids) == max_new_tokens:
                done[i] = True
        if all(done):
            break
        tokens[:, pos] = chosen
        if use_cache:
            logits = runner.last_logits(tokens[:, pos : pos + 1], cache, pos)
        else:
            logits = runner.last_logits(tokens[:, : pos + 1], None, 0)
        pos += 1
    return outs


def generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: Optional[SamplingParams] = None,
    eod: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
    return_logits: bool = False,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (model must be in eval mode);
    under model parallelism every rank of the model-parallel group calls it (see :func:`generate_batch`)."""
    return generate_batch(
        model,
        [prompt_ids],
        max_new_tokens,
        params,
        eod=eod,
        generators=None if generator is None else [generator],
        use_cache=use_cache,
        return_logits=return_logits,
    )[0]


def load_model(load_dir: str, iteration: Optional[int] = None, dtype: torch.dtype = torch.float32):
    """GPTModel (TP 1, PP 1, eval mode, one process: no process group) and its config from a
    checkpoint saved under any layout."""
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.verify import megalm_model_from_tensors

    reader = MegalmCheckpointReader(load_dir, iteration)
    cfg = copy.deepcopy(reader.config)
    if cfg.model.vocab_size is None:
        raise GenerationError(f"{reader.path}/common.json: the config has no vocab_size")
    model = megalm_model_from_tensors(cfg, reader.load(reader.model_names), dtype=dtype)
    return model.eval(), model.cfg, reader


def generation_config(
    cfg,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    dtype: torch.dtype = torch.float32,
):
    """A copy of a checkpoint's config set up for generation under TP x PP (x DP replicas): no
    sequence or context parallelism, no expert parallelism (experts replicated), no virtual
    stages, layers split evenly over the stages, vocabulary padded for the new TP size, and the
    precision flags (--bf16 / --fp16) those of ``dtype``, the dtype the model runs in."""
    from megalm.config import set_vocab_size

    cfg = copy.deepcopy(cfg)
    m, p = cfg.model, cfg.parallel
    tp, pp = int(tensor_model_parallel_size), int(pipeline_model_parallel_size)
    if tp < 1 or pp < 1:
        raise GenerationError(f"tensor/pipeline model parallel sizes must be >= 1, got {tp} and {pp}")
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    if m.num_attention_heads % tp or groups % tp:
        raise GenerationError(
            f"--tensor-model-parallel-size {tp} does not divide the model's {m.num_attention_heads} "
            f"attention heads / {groups} query groups"
        )
    if m.num_layers % pp:
        raise GenerationError(f"--pipeline-model-parallel-size {pp} does not divide the model's {m.num_layers} layers")
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.sequence_parallel = False
    p.context_parallel_size = p.expert_model_parallel_size = 1
    p.num_layers_per_virtual_pipeline_stage = p.num_virtual_stages_per_pipeline_rank = None
    p.virtual_pipeline_model_parallel_size = None
    p.decoder_first_pipeline_num_layers = p.decoder_last_pipeline_num_layers = None
    p.world_size, p.data_parallel_size = tp * pp * data_parallel_size, data_parallel_size
    cfg.training.bf16, cfg.training.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    if m.vocab_size is None:
        raise GenerationError("the checkpoint's config has no vocab_size")
    set_vocab_size(cfg, m.vocab_size)
    return cfg


def load_model_parallel(
    load_dir: str, iteration: Optional[int] = None, dtype: torch.dtype = torch.float32, *, groups: ProcessGroups
):
    """This rank's stage of a GPTModel (eval mode) under the layout of ``groups`` (this rank's
    :class:`megalm.parallel_state.ProcessGroups`: TP x PP; with data-parallel size > 1 every replica
    holds the whole model), loaded from a checkpoint saved under any layout.

    Collective: every rank of the world calls it.  Returns (model, config, checkpoint reader).
    """
    from megalm.checkpoint.errors import CheckpointError
    from megalm.checkpoint.load import load_checkpoint
    from megalm.checkpoint.resume import checkpoint_dir
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.device import get_device
    from megalm.models import GPTModel
    from megalm.models.layer_split import layers_for_stage

    tp, pp = group_size(groups.tp), group_size(groups.pp)
    if group_size(groups.cp) > 1:
        raise GenerationError("generation does not support context parallelism")
    reader = MegalmCheckpointReader(load_dir, iteration)
    root = os.path.dirname(os.path.normpath(reader.path))
    if os.path.normpath(checkpoint_dir(root, reader.iteration)) != os.path.normpath(reader.path):
        raise CheckpointError(
            f"{reader.path}: give the checkpoint root (the directory holding iter_* "
            f"directories) to load it under a parallel layout"
        )
    cfg = generation_config(reader.config, tp, pp, group_size(groups.dp), dtype)
    pp_rank = group_rank(groups.pp)
    # Eager kernels: prompt lengths and cache sizes change every call, compiled fusions would recompile.
    model = GPTModel(
        cfg,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        layer_numbers=layers_for_stage(cfg, pp_rank),
        fusion_plan=EAGER,
        process_groups=groups,
    ).to(get_device())
    load_checkpoint(root, [model], optimizer=None, finetune=True, iteration=reader.iteration)
    return model.to(dtype).eval(), cfg, reader


def tokenizer_for(
    cfg,
    tokenizer_type: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
):
    """The tokenizer named by the flags, else the one in the checkpoint's config.  A file flag
    not given is taken from the config when the type is the config's."""
    from megalm.tokenizers.build import create_tokenizer
    from megalm.tokenizers.null_tokenizer import NullTokenizer

    kind = tokenizer_type or cfg.data.tokenizer_type
    if kind is None:
        raise GenerationError(
            "the checkpoint's config names no tokenizer: pass --tokenizer-type (and --tokenizer-model)"
        )
    if tokenizer_type in (None, cfg.data.tokenizer_type):
        tokenizer_model = tokenizer_model or cfg.data.tokenizer_model
        vocab_file = vocab_file or cfg.data.vocab_file
        merge_file = merge_file or cfg.data.merge_file
    if kind == "NullTokenizer" and vocab_size is None:
        vocab_size = NullTokenizer.ids_for(cfg.model.vocab_size)  # the saved vocab_size is the tokenizer's
    tokenizer = create_tokenizer(kind, tokenizer_model, vocab_size, vocab_file, merge_file)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise GenerationError(
            f"tokenizer vocabulary {tokenizer.vocab_size} is larger than the model's {cfg.model.vocab_size}"
        )
    return tokenizer

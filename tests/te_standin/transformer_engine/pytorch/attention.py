"""Stand-in for ``transformer_engine.pytorch.DotProductAttention``: ``softmax(q k^T * scale + mask) v``
over this rank's heads (``num_attention_heads / tp`` query heads, ``num_gqa_groups / tp`` key/value
groups; query head ``j`` uses group ``j // (heads / groups)``), formats ``sbhd`` / ``bshd``, masks
``causal`` / ``no_mask``.  No communication.  Attention dropout draws inside
``get_rng_state_tracker().fork()`` unless sequence parallel or no tracker (TE 1.x's rule)."""

import contextlib
import math

import torch
import torch.nn.functional as F

from .distributed import get_distributed_world_size


class DotProductAttention(torch.nn.Module):
    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups=None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size=None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number=None,
        attention_type: str = "self",
        cp_group=None,
        cp_global_ranks=None,
        cp_stream=None,
        cp_comm_type: str = "p2p",
        softmax_scale=None,
    ):
        super().__init__()
        if window_size not in (None, (-1, -1), (-1, 0)) or cp_group is not None or attention_type != "self":
            raise NotImplementedError(
                "the Transformer Engine stand-in has no sliding window / context parallel / cross attention"
            )
        assert qkv_format in ("sbhd", "bshd"), f"qkv_format {qkv_format} not implemented in the stand-in"
        assert attn_mask_type in ("causal", "no_mask"), f"attn_mask_type {attn_mask_type} not implemented"
        self.tp_size = tp_size if tp_group is None else get_distributed_world_size(tp_group)
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        assert num_attention_heads % self.num_gqa_groups == 0, (
            "The number of attention heads must be divisible by the number of GQA groups!"
        )
        assert num_attention_heads % self.tp_size == 0 and self.num_gqa_groups % self.tp_size == 0
        self.heads_per_partition = num_attention_heads // self.tp_size
        self.groups_per_partition = self.num_gqa_groups // self.tp_size
        self.kv_channels = kv_channels
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.attention_dropout = attention_dropout
        self.softmax_scale = 1.0 / math.sqrt(kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_ctx = (
            contextlib.nullcontext
            if sequence_parallel or get_rng_state_tracker is None
            else get_rng_state_tracker().fork
        )

    def forward(
        self,
        query_layer,
        key_layer,
        value_layer,
        attention_mask=None,
        qkv_format=None,
        attn_mask_type=None,
        checkpoint_core_attention: bool = False,
        **unused,
    ):
        qkv_format = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        if attention_mask is not None or any(v is not None for v in unused.values()):
            raise NotImplementedError("the stand-in takes no explicit masks / packed sequences")
        if qkv_format == "sbhd":  # -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        else:
            q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))
        assert q.shape[1] == self.heads_per_partition and k.shape[1] == v.shape[1] == self.groups_per_partition, (
            tuple(q.shape),
            tuple(k.shape),
            self.heads_per_partition,
            self.groups_per_partition,
        )
        assert q.shape[-1] == self.kv_channels
        repeat = self.heads_per_partition // self.groups_per_partition
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)).float() * self.softmax_scale
        if mask_type == "causal":
            sq, sk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        p = self.attention_dropout if self.training else 0.0
        if p > 0.0:
            with self.dropout_ctx():
                probs = F.dropout(probs, p)
        out = torch.matmul(probs, v)  # [b, n, s, d]
        if qkv_format == "sbhd":
            out = out.permute(2, 0, 1, 3)
        else:
            out = out.transpose(1, 2)
        return out.reshape(out.shape[0], out.shape[1], -1)

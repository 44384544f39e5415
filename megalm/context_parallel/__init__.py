"""Context parallelism: the sequence split over the ``cp`` ranks of a group.

Each of the ``CP`` ranks holds two of the ``2 CP`` equal sequence chunks, ``i`` and
``2 CP - 1 - i`` (:mod:`.chunks`), so under the causal mask every rank does the same attention
work.  Everything but the attention core is per token and needs no communication over ``cp``;
the core comes in Megatron's three ``--cp-comm-type`` s (:mod:`.attention`):

- ``p2p``: ring attention (:mod:`.ring`), K/V blocks travel the ring;
- ``a2a``: Ulysses (:mod:`.ulysses`), all-to-all from sequence- to head-sharded and back;
- ``allgather``: K/V gathered over ``cp`` (:mod:`.allgather`).

:mod:`.blocks` holds the tiled block math (log-sum-exp merges, recomputing backward) the ring runs
and the other types use with attention dropout, whose mask is position-keyed (:mod:`.keyed_dropout`)
so the result does not depend on the split.
"""

from megalm.context_parallel.attention import COMM_TYPES, context_parallel_attention
from megalm.context_parallel.chunks import get_batch_on_this_cp_rank, local_positions, split_sequence

__all__ = [
    "COMM_TYPES",
    "context_parallel_attention",
    "get_batch_on_this_cp_rank",
    "local_positions",
    "split_sequence",
]

"""Data-parallel gradient buffers, bucketed reduction and gradient finalization."""

from megalm.distributed.comm import get_comm_stats, reset_comm_stats, total_comm_calls
from megalm.distributed.data_parallel import DistributedDataParallel, default_bucket_size
from megalm.distributed.finalize_model_grads import finalize_model_grads, unwrap_model
from megalm.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = [
    "Bucket",
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "default_bucket_size",
    "finalize_model_grads",
    "get_comm_stats",
    "reset_comm_stats",
    "total_comm_calls",
    "unwrap_model",
]

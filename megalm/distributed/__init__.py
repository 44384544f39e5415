"""Data-parallel gradient buffers, bucketed reduction and gradient finalization."""

from megalm.distributed.comm import CommStats
from megalm.distributed.data_parallel import DistributedDataParallel, default_bucket_size
from megalm.distributed.finalize_model_grads import finalize_model_grads, unwrap_model
from megalm.distributed.param_and_grad_buffer import Bucket, ParamAndGradBuffer

__all__ = [
    "Bucket",
    "CommStats",
    "DistributedDataParallel",
    "ParamAndGradBuffer",
    "default_bucket_size",
    "finalize_model_grads",
    "unwrap_model",
]

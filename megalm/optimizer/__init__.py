"""Optimizers with fp32 main weights, loss scaling and model-parallel gradient clipping."""

from megalm.optimizer.clip_grads import clip_grads_by_total_norm, grad_norm_and_zeros
from megalm.optimizer.distrib_optimizer import DistributedOptimizer
from megalm.optimizer.factory import build_optimizer, get_param_groups, named_parameters_for_optimizer
from megalm.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler, build_grad_scaler
from megalm.optimizer.optimizer import FP32Optimizer, MegatronOptimizer, MixedPrecisionOptimizer, OptimizerError

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "GradScaler",
    "MegatronOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerError",
    "build_grad_scaler",
    "build_optimizer",
    "clip_grads_by_total_norm",
    "get_param_groups",
    "grad_norm_and_zeros",
    "named_parameters_for_optimizer",
]

"""--init-model-with-meta-device in one process (:mod:`megalm.tensor_parallel.meta_init`): the model built on
the meta device and filled by DDP's buffers has the normal build's weights bit for bit, under every sharding
strategy, in fp32 and bf16; a module's buffers made by one factory call are made again on the real device;
a tensor computed at construction and a parameter without an init rule are refused, named.  (Peaks on the
allocator's count and training at DP 2: tests/test_zero3_peak.py; end to end: tests/test_sharding_strategy_training.py.)
"""

import copy

import pytest
import torch
from torch import nn

from megalm.models import GPTModel
from megalm.parallel_state import ProcessGroups
from megalm.tensor_parallel import mark_init
from megalm.tensor_parallel.initialization import initialize_weights
from megalm.tensor_parallel.meta_init import MetaDeviceMode, MetaInitError
from megalm.tensor_parallel.random import RNGStatesTracker
from megalm.training.build import build_model_chunks, wrap_data_parallel
from tests.checkpoint_fixtures import LLAMA
from tests.configs import TINY_GPT, make_config


def _gpt(cfg, pre_process=True, post_process=True, layer_numbers=None, *, process_groups, rng_tracker):
    return GPTModel(
        cfg, pre_process, post_process, layer_numbers, process_groups=process_groups, rng_tracker=rng_tracker
    )


def _weights(strategy, bf16, meta):
    cfg = copy.deepcopy(make_config(TINY_GPT, LLAMA, vocab_size=100))
    cfg.parallel.data_parallel_sharding_strategy, cfg.parallel.ddp_bucket_size = strategy, 1000
    cfg.parallel.init_model_with_meta_device, cfg.training.bf16 = meta, bf16
    groups = ProcessGroups.single()
    (ddp,) = wrap_data_parallel(cfg, build_model_chunks(cfg, _gpt, groups, RNGStatesTracker()), groups)
    if strategy == "optim_grads_params":
        ddp.gather_params()  # the full weights from the shards
    return {n: p.detach().clone() for n, p in ddp.named_parameters()}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_meta_build_gives_the_normal_weights(strategy):
    for bf16 in (False, True):
        plain, meta = _weights(strategy, bf16, False), _weights(strategy, bf16, True)
        assert plain.keys() == meta.keys() and len(plain) == 23
        for name, value in plain.items():
            assert not meta[name].is_meta and meta[name].dtype == value.dtype, name
            assert torch.equal(meta[name], value), name


class _WithBuffers(nn.Module):
    def __init__(self, computed: bool):
        super().__init__()
        self.weight = mark_init(nn.Parameter(torch.empty(4, 3)), "normal", 0.02)
        self.register_buffer("counts", torch.zeros(5, dtype=torch.int64, device="cpu"))
        self.table = torch.arange(6, device="cpu") * 2 if computed else torch.ones(2)


def test_buffers_are_replayed_and_computed_tensors_refused():
    mode = MetaDeviceMode()
    with mode:
        module = _WithBuffers(computed=False)
    assert module.weight.is_meta and module.counts.is_meta and module.table.is_meta
    mode.materialize_buffers([module])
    assert module.weight.is_meta  # parameters wait for DDP's buffers
    assert module.counts.device.type == "cpu" and torch.equal(module.counts, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(module.table, torch.ones(2))
    mode = MetaDeviceMode()
    with mode:
        computed = _WithBuffers(computed=True)
    with pytest.raises(MetaInitError, match=r"model\.table is a tensor computed at construction"):
        mode.materialize_buffers([computed])


def test_parameter_without_init_rule_is_refused():
    with MetaDeviceMode():
        layer = nn.Linear(3, 4)
    with pytest.raises(MetaInitError, match="weight has no init rule"):
        initialize_weights(layer, 0, None, None)

"""The data-parallel wrapper's flags are checked by validate_config (DDP reads them unchecked)."""

import pytest

from megalm.config import MegalmConfig, validate_config
from megalm.config.sections import ConfigError


def _cfg(**parallel):
    cfg = MegalmConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 32, 4, 48
    m.seq_length, m.max_position_embeddings, m.vocab_size = 16, 16, 100
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize(
    "parallel,message",
    [
        ({"overlap_param_gather": True}, "--overlap-param-gather needs --use-distributed-optimizer"),
        ({"ddp_bucket_size": 0}, "--ddp-bucket-size must be positive, got 0"),
        ({"ddp_bucket_size": -5, "use_distributed_optimizer": True}, "--ddp-bucket-size must be positive, got -5"),
    ],
)
def test_bad_data_parallel_flags_are_config_errors(parallel, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(**parallel))


def test_good_data_parallel_flags_pass():
    cfg = validate_config(_cfg(overlap_param_gather=True, use_distributed_optimizer=True, ddp_bucket_size=1))
    assert cfg.parallel.ddp_bucket_size == 1 and cfg.parallel.overlap_param_gather

"""The data-parallel wrapper's flags are checked by validate_config (DDP reads them unchecked)."""

import pytest

from megalm.config.sections import ConfigError
from tests.configs import make_config

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=100)
MODEL.update(seq_length=16, max_position_embeddings=16)


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
        make_config(MODEL, parallel)


def test_good_data_parallel_flags_pass():
    cfg = make_config(MODEL, overlap_param_gather=True, use_distributed_optimizer=True, ddp_bucket_size=1)
    assert cfg.parallel.ddp_bucket_size == 1 and cfg.parallel.overlap_param_gather

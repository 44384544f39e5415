"""Global batch size ramp-up (--rampup-batch-size) and microbatch counts."""

import pytest

from megalm.training.microbatches import MicrobatchCalculator


def test_constant_global_batch():
    calc = MicrobatchCalculator(64, 2, 4)
    assert calc.num_microbatches == 8
    calc.update(10_000)
    assert calc.current_global_batch_size == 64


def test_rampup_follows_megatron_formula():
    # start 16, +16 every (1000 / ((64 - 16) / 16)) = 333.3 samples, up to 64.
    calc = MicrobatchCalculator(64, 2, 2, rampup_batch_size=[16, 16, 1000])
    expected = {0: 16, 333: 16, 334: 32, 666: 32, 667: 48, 999: 48, 1000: 64, 5000: 64}
    for consumed, gbs in expected.items():
        calc.update(consumed)
        assert calc.current_global_batch_size == gbs, consumed
        assert calc.num_microbatches == gbs // 4


@pytest.mark.parametrize(
    "rampup, message", [([16, 15, 100], "not a multiple of the increment"), ([128, 16, 100], "start <= global batch")]
)
def test_rampup_errors(rampup, message):
    with pytest.raises(ValueError, match=message):
        MicrobatchCalculator(64, 2, 2, rampup_batch_size=rampup)

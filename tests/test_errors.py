"""megalm's one error base: every error megalm raises on purpose is a MegalmError and keeps its
older base (ValueError / RuntimeError) for existing ``except`` clauses; library parsing of
flags raises instead of exiting."""

from __future__ import annotations

import pytest

from megalm.checkpoint.async_writer import AsyncSaveError
from megalm.checkpoint.errors import CheckpointError
from megalm.config import ConfigError, build_parser
from megalm.conversion.errors import ConversionError
from megalm.data.indexed_dataset import IndexedDatasetError
from megalm.data.preprocess import PreprocessError
from megalm.data.text_sources import InputError
from megalm.errors import MegalmError, TrainingStopped
from megalm.fusions.backends import BackendUnavailable
from megalm.timers import TimerError
from megalm.training.metrics import WandbSetupError
from megalm.training.profiling import ProfilerUnavailable
from tests.distributed_harness import DistributedTestError


@pytest.mark.parametrize(
    "cls, older",
    [
        (ConfigError, ValueError),
        (ConversionError, ValueError),
        (CheckpointError, RuntimeError),
        (IndexedDatasetError, ValueError),
        (PreprocessError, RuntimeError),
        (InputError, ValueError),
        (AsyncSaveError, RuntimeError),
        (WandbSetupError, RuntimeError),
        (ProfilerUnavailable, RuntimeError),
        (BackendUnavailable, RuntimeError),
        (TimerError, RuntimeError),
        (DistributedTestError, RuntimeError),
        (TrainingStopped, Exception),
    ],
)
def test_every_error_is_a_megalm_error_and_keeps_its_older_base(cls, older):
    with pytest.raises(MegalmError) as caught:
        raise cls("boom")
    assert isinstance(caught.value, older) and str(caught.value) == "boom"


def test_library_parser_raises_config_error_instead_of_exiting():
    parser = build_parser(exit_on_error=False)
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        parser.parse_args(["--no-such-flag"])
    with pytest.raises(ConfigError, match="argument --num-layers: invalid int value: 'two'"):
        parser.parse_args(["--num-layers", "two"])
    assert parser.parse_args(["--num-layers", "3"]).__dict__["model.num_layers"] == 3
    with pytest.raises(SystemExit):  # the entry points' parser keeps argparse's exit status 2
        build_parser().parse_args(["--no-such-flag"])


def test_import_hf_flags_that_do_not_parse_are_a_conversion_error():
    from megalm.conversion.import_hf import build_config

    with pytest.raises(
        ConversionError,
        match=r"cannot parse the megalm flags \['--no-such-flag'\]: "
        r"unrecognized arguments: --no-such-flag",
    ):
        build_config({}, ["--no-such-flag"])


def test_import_hf_refuses_fields_that_are_not_megalm_model_fields():
    from megalm.conversion.import_hf import build_config

    with pytest.raises(ConversionError, match=r"sets \['num_layerz'\], which are not megalm model fields"):
        build_config({"num_layerz": 2, "max_position_embeddings": 16}, [])


def test_bad_flags_met_outside_validation_raise_megalm_errors():
    """Library code reached with a flag value validation would refuse (a config built in code) names
    the flag in a MegalmError, not a bare ValueError."""
    import types

    import torch

    from megalm.inference.generation import GenerationError, generation_config
    from megalm.inference.sampling import SamplingParams
    from megalm.models.layer_split import layers_per_rank
    from megalm.training.microbatches import MicrobatchCalculator, ScheduleError
    from megalm.transformer.moe.moe_layer import moe_layer_pattern
    from megalm.transformer.te_layers import TESelfAttention

    q = torch.zeros(2, 1, 1, 4)
    with pytest.raises(ConfigError, match="--reset-attention-mask is not supported with --transformer-impl"):
        TESelfAttention.attention_core(None, q, q, q, attention_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool))
    with pytest.raises(ConfigError, match="--top-p must be in"):
        SamplingParams(top_p=0.0).validate()
    cfg = types.SimpleNamespace(
        model=types.SimpleNamespace(num_layers=5, num_experts=4, moe_layer_freq=[1, 0]),
        parallel=types.SimpleNamespace(pipeline_model_parallel_size=2),
    )
    cfg.parallel.decoder_first_pipeline_num_layers = cfg.parallel.decoder_last_pipeline_num_layers = None
    with pytest.raises(ConfigError, match="--num-layers 5 is not divisible by pipeline size 2"):
        layers_per_rank(cfg)
    with pytest.raises(ConfigError, match="--moe-layer-freq has 2 entries for 5 layers"):
        moe_layer_pattern(cfg.model)
    with pytest.raises(ScheduleError, match="--rampup-batch-size"):
        MicrobatchCalculator(8, 1, 1, rampup_batch_size=[16, 4, 100])
    gen = build_parser(exit_on_error=False).parse_args(["--num-layers", "3", "--num-attention-heads", "4"])
    from megalm.config import config_from_args

    with pytest.raises(GenerationError, match="--pipeline-model-parallel-size 2 does not divide the model's 3 layers"):
        generation_config(config_from_args(gen), pipeline_model_parallel_size=2)
    from megalm.data.indexed_dataset import DataError
    from megalm.data.samplers import MegatronPretrainingSampler

    with pytest.raises(DataError, match="consumed_samples 20 is outside \\[0, total_samples 10\\]"):
        MegatronPretrainingSampler(10, 20, 1, 0, 1)  # a checkpoint resumed on a smaller dataset
    assert issubclass(ScheduleError, MegalmError) and issubclass(GenerationError, (MegalmError, ValueError))

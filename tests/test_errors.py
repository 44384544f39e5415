"""megalm's one error base: every error megalm raises on purpose is a MegalmError and keeps its
older base (ValueError / RuntimeError) for existing ``except`` clauses; library parsing of
flags raises instead of exiting."""

from __future__ import annotations

import pytest

from megalm.async_save import AsyncSaveError
from megalm.checkpointing import CheckpointError
from megalm.config import ConfigError, build_parser
from megalm.conversion.errors import ConversionError
from megalm.data.indexed_dataset import IndexedDatasetError
from megalm.data.preprocess import PreprocessError
from megalm.data.text_sources import InputError
from megalm.errors import MegalmError, TrainingStopped
from megalm.fusions.backends import BackendUnavailable
from megalm.testing import DistributedTestError
from megalm.timers import TimerError
from megalm.training.metrics import WandbSetupError
from megalm.training.profiling import ProfilerUnavailable


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

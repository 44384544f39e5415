"""Checkpoints written by an earlier megalm (commit c2855cf, ``tests/fixtures/checkpoints_c2855cf``):

* they load with today's code and training continues with the losses that code had when it resumed
  from them, bit for bit: int8 gradient compression under TP 2 x DP 2 (per-rank residuals and
  rounding generator) and DiLoCo under PP 2 x DP 2 (each replica's weights and optimizer, the outer
  state);
* copies with one poisoned file (a pickle that would create a marker file if unpickled; the
  manifest recomputed, so the sha256 check passes) are refused as a user sees it: ``--load`` ends on
  every rank in one ``error: ...`` line naming the file, for a per-rank ``rng/``,
  ``grad_compression/`` or ``local_sgd/`` file and for a ``.distcp`` data file; ``tools/generate.py``
  and ``tools/checkpoint/convert.py`` print one such line for the ``.distcp``.  Nothing runs.

The trainings run on one group of 4 gloo ranks."""

import json
import os
import pickle
import runpy
import shutil
from pathlib import Path

import pytest

from megalm.checkpoint import manifest
from tests.distributed_harness import run_distributed
from tests.training_runs import losses

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "checkpoints_c2855cf"
ITERATION = 2
# (case, fixture, file of the iteration directory to poison)
POISONED = [
    ("rng", "int8_tp2_dp2", "rng/rank_00001.pt"),
    ("grad_compression", "int8_tp2_dp2", "grad_compression/rank_00002.pt"),
    ("local_sgd", "diloco_pp2_dp2", "local_sgd/rank_00003.pt"),
    ("distcp", "int8_tp2_dp2", "__1_0.distcp"),
]


class _Touch:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def poison(root: Path, name: str, marker: Path) -> Path:
    """Replace (the first tensor record of) ``name`` with a pickle that runs ``touch marker``, then
    recompute the manifests (each rank's and the index) so that the checkpoint verifies."""
    path = root / f"iter_{ITERATION:07d}"
    file = path / name
    data = pickle.dumps(_Touch(marker), protocol=2)
    if name.endswith(".distcp"):  # DCP reads each record at its offset: overwrite the one at 0
        raw = bytearray(file.read_bytes())
        raw[: len(data)] = data
        file.write_bytes(bytes(raw))
    else:
        file.write_bytes(data)
    index, _ = manifest.read_index(str(path))
    for rank in manifest.saved_ranks(index):
        manifest.write_rank_manifest(str(path), rank)
    manifest.write_index(str(path), ITERATION, len(manifest.saved_ranks(index)))
    return file


def resume_each(tmp, expected):
    import torch.distributed as dist

    from tests.training_runs import run_trainings

    runs = []
    for name, case in expected["cases"].items():
        metrics = os.path.join(tmp, f"{name}.jsonl")
        runs.append(expected["tiny_argv"] + case["argv"] + ["--load", os.path.join(tmp, name)])
        runs[-1] += ["--train-iters", "4", "--metrics-file", metrics]
    for case, fixture, _ in POISONED:
        argv = expected["tiny_argv"] + expected["cases"][fixture]["argv"]
        runs.append(argv + ["--load", os.path.join(tmp, f"poisoned_{case}"), "--train-iters", "4"])
    codes = run_trainings(runs)
    dist.barrier()  # the logging rank has closed its metrics files
    return codes


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compat")
    with open(FIXTURES / "expected.json") as f:
        expected = json.load(f)
    for name in expected["cases"]:
        shutil.copytree(FIXTURES / name, tmp / name)
    poisoned = {}
    for case, fixture, name in POISONED:
        shutil.copytree(FIXTURES / fixture, tmp / f"poisoned_{case}")
        poisoned[case] = (poison(tmp / f"poisoned_{case}", name, tmp / f"marker_{case}"), tmp / f"marker_{case}")
    codes = run_distributed(resume_each, 4, args=(str(tmp), expected), timeout=400)
    return {"tmp": str(tmp), "expected": expected, "codes": codes, "poisoned": poisoned}


def test_checkpoints_of_c2855cf_resume_with_its_losses(world):
    expected = world["expected"]
    n = len(expected["cases"])
    for codes in world["codes"]:
        assert codes[:n] == [0] * n, codes
    for name, case in expected["cases"].items():
        got = losses(world["tmp"], name)
        assert len(got) == 2 and got == case["resumed"], (name, got, case["resumed"])
        assert got != case["full"][:2]  # iterations 3 and 4, not a run from scratch


def _assert_one_line_error(message, file, marker, prefix="error: "):
    assert isinstance(message, str) and message.startswith(prefix), message
    assert "\n" not in message.strip(), message
    assert str(file) in message, message
    assert not marker.exists()


def test_poisoned_files_end_load_in_one_error_line_on_every_rank(world):
    n = len(world["expected"]["cases"])
    for rank, codes in enumerate(world["codes"]):
        for (case, _, _), message in zip(POISONED, codes[n:]):
            file, marker = world["poisoned"][case]
            _assert_one_line_error(message, file, marker)
            assert "refusing to unpickle: Trying to load unsupported GLOBAL" in message, message
            if case != "distcp":
                assert message.startswith(f"error: cannot read {file}: refusing to unpickle"), message


def _tool(name):
    return runpy.run_path(str(REPO / "tools" / name))["main"]


def test_tools_refuse_a_poisoned_distcp_in_one_error_line(world, tmp_path, capsys):
    file, marker = world["poisoned"]["distcp"]
    root = str(Path(world["tmp"]) / "poisoned_distcp")
    code = _tool("checkpoint/convert.py")(["--to", "hf", "--load-dir", root, "--save-dir", str(tmp_path / "hf")])
    assert code not in (0, None)
    message = capsys.readouterr().err.strip()
    _assert_one_line_error(message, file, marker, prefix="[convert] error: ")
    assert "refusing to unpickle" in message
    assert not (tmp_path / "hf" / "config.json").exists()  # the export stopped at the first tensors
    code = _tool("generate.py")(["--load", root, "--prompt", "1 2 3", "--max-new-tokens", "2"])
    assert code not in (0, None)
    message = capsys.readouterr().err.strip()
    _assert_one_line_error(message, file, marker)
    assert "refusing to unpickle" in message

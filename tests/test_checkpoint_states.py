"""The registration contract of megalm.checkpoint.stateful, on one process: a state a new feature
registers is saved to ``<name>/rank_<rank>.pt`` (listed in the manifest, so verified), restored
under the same layout, handed to ``not_restored`` under another one or when it has no file, and
a file it cannot read is a one-line CheckpointError naming it; the checkpointer names no feature."""

import ast
import json
from pathlib import Path

import pytest
import torch

from megalm.checkpoint import manifest
from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.load import load_checkpoint
from megalm.checkpoint.save import save_checkpoint
from megalm.checkpoint.stateful import CheckpointStates
from megalm.parallel_state import get_process_groups
from tests.checkpoint_fixtures import tiny_cfg

PACKAGE = Path(__file__).resolve().parents[1] / "megalm" / "checkpoint"


class Counter:
    """A component with state of its own: a step count and a tensor."""

    def __init__(self, n=0):
        self.n, self.total = n, torch.full((3,), float(n))
        self.why = None

    def state_dict(self):
        return {"n": self.n, "total": self.total.clone()}

    def load_state_dict(self, state):
        self.n, self.total = state["n"], state["total"]

    def not_restored(self, info, reason):
        self.why = reason


def _states(counter):
    states = CheckpointStates()
    states.register("counter", counter)
    return states


def test_registry_refuses_bad_registrations():
    states = _states(Counter())
    with pytest.raises(ValueError, match="registered twice"):
        states.register("counter", Counter())
    with pytest.raises(ValueError, match="identifier"):
        states.register("../x", Counter())
    with pytest.raises(TypeError, match="state_dict"):
        states.register("x", object())
    assert "counter" in states and "counter" not in states.without("counter") and len(states) == 1


def test_a_registered_state_round_trips_and_is_verified(tmp_path):
    from megalm.models import GPTModel

    model = GPTModel(tiny_cfg(64), process_groups=get_process_groups())
    save_checkpoint(str(tmp_path), 3, [model], states=_states(Counter(5)))
    it = tmp_path / "iter_0000003"
    assert (it / "counter" / "rank_00000.pt").is_file()
    assert "counter/rank_00000.pt" in json.loads((it / "manifest" / "rank_00000.json").read_text())["files"]

    restored = Counter()
    load_checkpoint(str(tmp_path), [model], states=_states(restored))
    assert restored.n == 5 and torch.equal(restored.total, torch.full((3,), 5.0)) and restored.why is None

    # under another layout the file is not read: the state is told why
    original = (it / "common.json").read_text()
    common = json.loads(original)
    common["layout"] = dict(common["layout"], data_parallel_size=2)
    (it / "common.json").write_text(json.dumps(common))
    manifest.write_for_one_process(str(it), 3)
    other = Counter()
    load_checkpoint(str(tmp_path), [model], states=_states(other))
    assert other.n == 0 and other.why == f"it was saved with layout {common['layout']}"

    # a registered name with no file under the same layout: "it has none"
    (it / "common.json").write_text(original)
    manifest.write_for_one_process(str(it), 3)
    absent, states = Counter(), CheckpointStates()
    states.register("absent", absent)
    load_checkpoint(str(tmp_path), [model], states=states)
    assert absent.why == "it has none"

    # a file it cannot read: one line naming it
    (it / "counter" / "rank_00000.pt").write_bytes(b"not a checkpoint")
    manifest.write_for_one_process(str(it), 3)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tmp_path), [model], states=_states(Counter()))
    assert str(e.value).startswith(f"cannot read {it / 'counter' / 'rank_00000.pt'}: ") and "\n" not in str(e.value)


class Position:
    """A state kept in common.json only (as the trainer's scheduler and data position)."""

    def __init__(self, samples=0, key="samples"):
        self.samples, self.key = samples, key

    def state_dict(self):
        return None

    def load_state_dict(self, state):
        raise AssertionError("no file was written")

    def common_state_dict(self):
        return {self.key: self.samples}

    def load_common_state_dict(self, info):
        self.samples = info.common[self.key]


def test_common_json_entries_of_a_state_round_trip_and_may_not_collide(tmp_path):
    from megalm.models import GPTModel

    model = GPTModel(tiny_cfg(64), process_groups=get_process_groups())
    states = CheckpointStates()
    states.register("position", Position(96))
    save_checkpoint(str(tmp_path), 2, [model], states=states)
    it = tmp_path / "iter_0000002"
    assert json.loads((it / "common.json").read_text())["samples"] == 96 and not (it / "position").exists()
    restored = CheckpointStates()
    restored.register("position", Position())
    load_checkpoint(str(tmp_path), [model], states=restored)
    assert restored.get("position").samples == 96
    for key in ("iteration", "layout"):  # the checkpointer's own keys are refused, naming the state
        taken = CheckpointStates()
        taken.register("position", Position(1, key))
        with pytest.raises(CheckpointError, match=f"state 'position' writes common.json's '{key}'"):
            save_checkpoint(str(tmp_path), 3, [model], states=taken)


def _code_words(tree):
    """Names, attributes, imported modules and non-docstring strings of a module's code."""
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.alias):
            yield node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value


def test_the_checkpointer_names_no_feature():
    """megalm/checkpoint/ imports nothing of distributed/, optimizer/, training/, and its code names no
    feature (components register their state); only docstrings describe the files they write."""
    for file in sorted(PACKAGE.glob("*.py")):
        for word in _code_words(ast.parse(file.read_text())):
            assert not word.startswith(("megalm.distributed", "megalm.optimizer", "megalm.training")), (file, word)
            for feature in ("compression", "local_sgd", "outer", "diloco", "powersgd", "int8"):
                assert feature not in word.lower().replace("uint8", "byte"), (file.name, word)  # a dtype
    # save and load name none of the trainer's states either (scheduler, data position, RNG: registered)
    for file in (PACKAGE / "save.py", PACKAGE / "load.py"):
        for word in _code_words(ast.parse(file.read_text())):
            for state in ("scheduler", "consumed", "rng"):
                assert state not in word.lower(), (file.name, word)

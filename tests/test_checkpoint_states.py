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
from megalm.checkpoint.load import load_checkpoint, load_checkpoint_states
from megalm.checkpoint.model_state import ModelOptimizerState
from megalm.checkpoint.save import save_checkpoint, save_checkpoint_states
from megalm.checkpoint.stateful import CheckpointStates
from megalm.parallel_state import get_process_groups
from megalm.param_layout import ShardedTensorSpec
from tests.configs import TINY_GPT, make_config

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

    model = GPTModel(make_config(TINY_GPT, vocab_size=64), process_groups=get_process_groups())
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

    model = GPTModel(make_config(TINY_GPT, vocab_size=64), process_groups=get_process_groups())
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


class Table:
    """A state of DCP blocks only (as the model and optimizer): a replicated tensor, no file."""

    def __init__(self, value):
        self.value = torch.full((4, 2), float(value))

    def state_dict(self):
        return None

    def load_state_dict(self, state):
        raise AssertionError("no file was written")

    def sharded_state_dict(self):
        return {"table.value": ShardedTensorSpec.replicated(self.value)}

    def sharded_load_plan(self, info):
        assert info.saved_tensors["table.value"] == (4, 2)
        return {"table.value": ShardedTensorSpec.replicated(self.value)}


def test_the_model_is_a_registered_state_like_any_other(tmp_path):
    """The checkpointer's core saves and loads registered states only: without a model (a state of DCP
    blocks), and with the model and optimizer registered as one state, which writes the DCP tensors and
    common.json's optimizer_common exactly as save_checkpoint(model, optimizer) does."""
    from megalm.models import GPTModel

    groups = get_process_groups()
    states = CheckpointStates()
    states.register("table", Table(7))
    save_checkpoint_states(str(tmp_path / "bare"), 1, states, groups)
    assert not (tmp_path / "bare" / "iter_0000001" / "table").exists()
    restored = CheckpointStates()
    restored.register("table", Table(0))
    common = load_checkpoint_states(str(tmp_path / "bare"), restored, groups)
    assert torch.equal(restored.get("table").value, torch.full((4, 2), 7.0)) and "optimizer_common" not in common

    model = GPTModel(make_config(TINY_GPT, vocab_size=64), process_groups=groups)
    registered = CheckpointStates()
    registered.register("model", ModelOptimizerState([model], None, groups))
    save_checkpoint_states(str(tmp_path / "registered"), 2, registered, groups)
    save_checkpoint(str(tmp_path / "wrapper"), 2, [model])
    saved = [json.loads((tmp_path / r / "iter_0000002" / "common.json").read_text()) for r in ("registered", "wrapper")]
    assert {k: v for k, v in saved[0].items() if k != "saved_at"} == {
        k: v for k, v in saved[1].items() if k != "saved_at"
    }
    assert saved[0]["optimizer_common"] is None
    other = GPTModel(make_config(TINY_GPT, vocab_size=64), process_groups=groups)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    again = CheckpointStates()
    again.register("model", ModelOptimizerState([other], None, groups))
    load_checkpoint_states(str(tmp_path / "registered"), again, groups)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_checkpointer_core_names_neither_model_nor_optimizer():
    """Only the compatibility wrappers for callers holding a model (save_checkpoint, load_checkpoint) and
    the state that is the model and optimizer (model_state.py) name them; the core saves and loads states."""
    wrappers = {"save_checkpoint", "load_checkpoint"}
    for name, only in (("save.py", None), ("load.py", None), ("stateful.py", None), ("local.py", "LocalCheckpoint")):
        tree = ast.parse((PACKAGE / name).read_text())
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name in wrappers:
                continue
            if only is not None and node.name != only:
                continue
            for word in _code_words(node):
                assert "optim" not in word.lower() and "model" not in word.lower(), (name, node.name, word)


def test_the_trainer_registers_the_model_first_and_a_local_copy_keeps_everything():
    """--no-save-optim / --no-save-rng leave the optimizer, scheduler and RNG out of disk checkpoints only:
    the trainer's local-checkpoint states keep them (a local copy resumes the same job); --finetune and
    --no-load-optim load the weights alone."""
    from types import SimpleNamespace

    from megalm.models import GPTModel
    from megalm.training.trainer_setup import TrainerSetup

    class Optimizer:
        def common_state_dict(self):
            return {"step": 4}

        def sharded_state_dict(self, params):
            return {f"optimizer.{name}.exp_avg": ShardedTensorSpec.replicated(p) for name, p in params.items()}

    class Scheduler:
        def state_dict(self):
            return {"num_steps": 4}

    groups = get_process_groups()
    model_cfg = make_config(TINY_GPT, vocab_size=64)
    for no_save, no_load, finetune in ((True, False, False), (False, True, False), (False, False, True)):
        flags = SimpleNamespace(no_save_optim=no_save, no_save_rng=no_save, no_load_optim=no_load, finetune=finetune)
        cfg = SimpleNamespace(checkpoint=flags, parallel=model_cfg.parallel)
        trainer = SimpleNamespace(
            cfg=cfg,
            model=[GPTModel(model_cfg, process_groups=groups)],
            optimizer=Optimizer(),
            scheduler=Scheduler(),
            groups=groups,
            state=SimpleNamespace(consumed_train_samples=12, consumed_valid_samples=0),
            outer_sync=None,
            rng_tracker=None,
        )
        disk, local = (TrainerSetup._checkpoint_states(trainer, local=flag) for flag in (False, True))
        assert [name for name, _ in disk.items()] == ["model", "scheduler", "data", "rng"]
        for states, keeps in ((disk, not no_save), (local, True)):
            common = {k: v for _, s in states.items() for k, v in s.common_state_dict().items()}
            assert common["optimizer_common"] == ({"step": 4} if keeps else None), (no_save, common)
            assert common["scheduler"] == ({"num_steps": 4} if keeps else None) and common["rng_saved"] is keeps
            assert any(k.startswith("optimizer.") for k in states.get("model").sharded_state_dict()) is keeps
        assert disk.get("model").load_optim is not (no_load or finetune)

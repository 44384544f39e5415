"""The trainer's own state as checkpoint states (:mod:`megalm.checkpoint.stateful`), registered by
:meth:`megalm.training.trainer_setup.TrainerSetup.setup` beside the features' and the RNG's: the LR
scheduler and the data position.  Both are small values every rank shares, kept in ``common.json``
under the keys Megatron-LM users know (``scheduler``, ``consumed_train_samples``,
``consumed_valid_samples``); neither writes a per-rank file.  No communication."""

from __future__ import annotations

from typing import Optional

from megalm.training.step import TrainState


class SchedulerState:
    """The LR / weight-decay scheduler in ``common.json``'s ``scheduler`` (None when ``save`` is False:
    ``--no-save-optim``); restored (with the checks of ``--override-opt-param-scheduler`` /
    ``--use-checkpoint-opt-param-scheduler``) when the checkpoint has one."""

    def __init__(self, scheduler, save: bool = True):
        self.scheduler, self.save = scheduler, save

    def state_dict(self) -> None:
        return None  # no per-rank file

    def load_state_dict(self, state) -> None:
        pass  # never called: there is no file

    def common_state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict() if self.save else None}

    def load_common_state_dict(self, info) -> None:
        saved: Optional[dict] = info.common.get("scheduler")
        if saved is not None:
            self.scheduler.load_state_dict(saved)


class DataPosition:
    """The samples consumed so far (``state``'s counters), from which the samplers resume."""

    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self) -> None:
        return None  # no per-rank file

    def load_state_dict(self, state) -> None:
        pass  # never called: there is no file

    def common_state_dict(self) -> dict:
        return {
            "consumed_train_samples": self.state.consumed_train_samples,
            "consumed_valid_samples": self.state.consumed_valid_samples,
        }

    def load_common_state_dict(self, info) -> None:
        self.state.consumed_train_samples = info.common["consumed_train_samples"]
        self.state.consumed_valid_samples = info.common["consumed_valid_samples"]

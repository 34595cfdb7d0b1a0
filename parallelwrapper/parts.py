"""The parts of one copy of the training (model, optimizer, schedule, outer optimizer) and their one `TrainingState`.

`.lr_scheduler(...)` and `.outer_optimizer(...)` add the schedule and the outer optimizer; the
`TrainingState` is what they are saved and loaded as. A fleet's replica in a group smaller than
planned steps on its share of each round's move (outer.py), with the outer optimizer or, without
one, with plain averaging's step, which holds no state.

Each worker holds one (worker.Replica, on its copy of the model), and the wrapper holds one on
the user's model: a fit() starts every worker from the wrapper's state and ends by loading rank
0's into it, and a checkpoint is the same state on disk.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from .batches import to_cpu
from .job import Job, OuterSpec
from .outer import OuterStep
from .rounds.state import optimizer_state_tensors, trained_parameters
from .schedule import Schedule, make_schedule
from .shared_state import reside, ship
from .types import StateDict, TrainingState

# Plain averaging as an outer step: θ_start − 1·Δ (outer.py), of which a share is taken.
_PLAIN = OuterSpec(torch.optim.SGD, {"lr": 1.0})


class Parts:
    """A model and its optimizer, schedule and outer optimizer (each built as the job says)."""

    def __init__(self, model: torch.nn.Module, job: Job, world_size: int, share: float = 1.0) -> None:
        """`world_size`: the workers the run is planned for (Config.planned_workers), by which a
        per-step schedule counts; `share`: of each round's move to the average (outer.py)."""
        self.model = model
        self.optimizer = job.make_optimizer(model)
        self.schedule: Schedule | None = make_schedule(job.lr_scheduler, self.optimizer, world_size)
        trained = trained_parameters(model, self.optimizer)
        self.outer = None if job.outer_optimizer is None else OuterStep(job.outer_optimizer, trained, share)
        self._partial = OuterStep(_PLAIN, trained, share) if self.outer is None and share != 1.0 else None

    @property
    def landing(self) -> OuterStep | None:
        """The step a landed average takes: the outer optimizer's, or plain averaging's on a share
        of the move; None: the average is the model's."""
        return self.outer if self.outer is not None else self._partial

    def state(self) -> TrainingState:
        """Every part's state, on the CPU: a copy, which training the parts does not change."""
        return self._dicts(to_cpu)

    def shipped(self) -> TrainingState:
        """Every part's state as one process sends it to another (shared_state.py): the model's and
        the optimizer's own CPU tensors, moved into shared memory (once), not copies of them. The
        main process sends its state so at a fit's start (the workers load it by copy, and nobody
        writes to it during the fit), worker 0 its own at a fit's end (it trains on it again only
        after loading the next fit's: the receiver may keep it, and the next `load` leaves it to
        it). Each part has buffers of its own, so that the receiver lets the model's go while it
        keeps the optimizer's."""
        reside([*self.model.parameters(), *self.model.buffers()])
        reside(optimizer_state_tensors(self.optimizer))
        return ship(self._dicts(lambda tensors: tensors))

    def _dicts(self, tensors: Callable[[StateDict], StateDict]) -> TrainingState:
        """Every part's state dict, its tensors through `tensors` (the schedule's lists copied)."""
        return TrainingState(
            tensors(self.model.state_dict()),
            tensors(self.optimizer.state_dict()),
            None if self.schedule is None else copy.deepcopy(self.schedule.state_dict()),  # lists the scheduler keeps
            None if self.outer is None else tensors(self.outer.state_dict()),
        )

    def load(self, state: TrainingState, *, take: bool = False, restart: bool = True) -> None:
        """Load every part's state; the optimizers cast theirs to their parameters' device. With
        `take`, the state is the caller's to give away (nobody else holds it, nor will write to
        it): the optimizers keep its tensors instead of copies. The optimizer loads first, so that
        its old state is let go before the model's parameters are copied in. Without `restart`, the
        parameters loaded are a round's progress, not its start: the anchor stays (a resumed round)."""
        # Every worker receives the same shared-memory tensors, and an optimizer keeps the tensors
        # it loads when they already have the right device and dtype (Adam's step is increased
        # in place): without a copy, the workers would step one shared counter.
        self.optimizer.load_state_dict(state.optimizer if take else to_cpu(state.optimizer))
        self.model.load_state_dict(state.model)
        if self.schedule is not None and state.lr_scheduler is not None:
            self.schedule.load_state_dict(state.lr_scheduler)
        if self.landing is not None and restart:
            self.landing.restart()  # the loaded parameters are the next round's start
        if self.outer is not None and state.outer_optimizer is not None:
            self.outer.load_state_dict(state.outer_optimizer if take else to_cpu(state.outer_optimizer))


__all__ = ["Parts"]

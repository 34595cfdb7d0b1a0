"""One worker's replica: its own model and optimizer, a step on a batch, and the NaN policy.

The replica knows nothing of processes, queues or files, nor of the loop that trains it: its host
(hosts/runtime.Worker) builds it and, beside it, its round loop (rounds.Rounds), which calls it for
its steps, at each landing and at a fit's edges (the rounds.Trainer protocol); it never calls the loop.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping

import torch

from .batches import batch_size, describe, move_to, split
from .checkpoint import rng_state
from .config import Config, NanPolicy
from .errors import TrainingError, Where
from .evaluation import autocast, metric_sums, validation_metrics
from .feed.shard import rank_share
from .hooks import Hooks, Phase
from .job import Job
from .parts import Parts
from .types import Batch, Counters, StateDict, TrainingState


class Replica:
    """One worker's model, optimizer, schedule and steps: what its round loop trains."""

    def __init__(
        self,
        model: torch.nn.Module,
        job: Job,
        config: Config,
        device: torch.device,
        rank: int,
        world_size: int,
        *,
        hooks: Hooks | None = None,
    ) -> None:
        # A fleet's group smaller than planned moves the model its share of the way to each average.
        planned = config.planned_workers(world_size)
        share = min(1.0, world_size / planned) if config.fleet_rescale else 1.0
        self.parts = Parts(model, job, planned, share)  # its optimizer, schedule and outer optimizer
        self.model, self.optimizer, self.schedule = model, self.parts.optimizer, self.parts.schedule
        self.job, self.config, self.device, self.rank, self.world_size = job, config, device, rank, world_size
        self.hooks = hooks or Hooks()
        self.local_steps = 0  # optimizer steps this worker has taken, for error messages
        # 16-mixed: the worker's own loss scale. In SHARED_GRADIENTS every worker unscales the same
        # averaged gradients, so every scaler skips the same steps and keeps the same scale.
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "16-mixed" else None
        self._stopper = copy.deepcopy(job.early_stopping)  # this worker's own: it decides here
        self._best: TrainingState | None = None  # EarlyStopping(restore_best)

    # -- state ----------------------------------------------------------------------------------

    def load_state(self, state: TrainingState) -> None:
        """Start from the main process's state (every fit() starts from it). The model is on its
        device already, so the optimizers' state is cast to the params' device. Its tensors are
        new ones: the round loop builds its buffers afresh (Rounds.reset)."""
        self.parts.load(state)

    def resume_state(self, state: TrainingState) -> None:
        """Take `state`, this worker's own in a round in flight, over the round's start that
        `load_state` loaded: its anchor (an outer step's, a share's) stays the start."""
        self.parts.load(state, restart=False)

    def state_dicts(self) -> TrainingState:
        """Every part's state on the CPU: a copy (Parts.state)."""
        return self.parts.state()

    def whole_state(self) -> TrainingState:
        """The whole model's state on every process of this worker: its own (a pipeline's stage
        gathers its stages')."""
        return self.state_dicts()

    def shipped_state(self) -> TrainingState:
        """Every part's own state, moved into shared memory to go to the main process at a fit's
        end (Parts.shipped)."""
        return self.parts.shipped()

    def saved_state(self, writes: bool) -> TrainingState | None:
        """What a checkpoint holds, on the process that `writes` it: this worker's state."""
        return self.state_dicts() if writes else None

    def own_state(self) -> StateDict:
        """What is this worker's alone, for a checkpoint: its RNG state and its loss scale (its
        round loop adds its own: Rounds.own_state)."""
        own: StateDict = rng_state()
        if self.scaler is not None:
            own["grad_scaler"] = self.scaler.state_dict()
        return own

    def load_own_state(self, own: StateDict) -> None:
        """Take `own`'s loss scale (its RNG state is the host's to set: hosts/runtime.Worker)."""
        if self.scaler is not None and "grad_scaler" in own:
            self.scaler.load_state_dict(own["grad_scaler"])

    def fit_starts(self) -> None:
        """A fit trains the model, and early stopping starts afresh."""
        self.model.train()
        if self._stopper is not None:
            self._stopper.reset()
            self._best = None

    def fit_ends(self) -> None:
        """With EarlyStopping(restore_best=True), the fit ends holding the best validation's
        state, whether it stopped early or not."""
        if self._best is not None:
            self.parts.load(self._best, take=True)  # every worker holds the same: the fit's buffers are released
            self._best = None

    # -- one step -------------------------------------------------------------------------------

    def loss(self, batch: Batch) -> torch.Tensor:
        if self.job.training_step is not None:
            return self.job.training_step(self.model, batch)
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise TrainingError(
                f"expected an (inputs, targets) batch, got a {type(batch).__name__} {describe(batch)}; for a model that "
                f"computes its own loss (a Hugging Face model given labels) use .loss_from_output(), for other batches "
                f".training_step(fn) with fn(model, batch) -> loss"
            )
        inputs, targets = batch
        assert self.job.loss_fn is not None
        return self.job.loss_fn(self.model(inputs), targets)

    def accumulate(self, epoch: int, index: int, batch: Batch) -> tuple[torch.Tensor, int]:
        """Forward and backward: loss·n (detached, on device) and the sample count n; gradients
        accumulate in .grad. Every failure is a TrainingError that says where."""
        self.hooks.progress(Phase.TRAINING, epoch, index, self.local_steps)
        try:
            n = batch_size(batch)
            loss = self.forward_backward(move_to(batch, self.device))
        except Exception as e:
            cause = str(e) if isinstance(e, TrainingError) else f"{type(e).__name__}: {e}"
            raise TrainingError(cause, Where(epoch, index, self.local_steps, describe(batch))) from e
        return loss.detach().float().reshape(()) * n, n

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """The batch's loss (on the device), its gradients added to .grad. With accumulate(n) the
        batch goes through as n micro-batches, each's loss weighted by its share of the samples:
        the sum of their gradients is the whole batch's (of a mean loss)."""
        if self.config.accumulate == 1:
            return self._backward(batch, 1.0)
        n = batch_size(batch)
        losses = [self._backward(micro, batch_size(micro) / n) for micro in split(batch, self.config.accumulate)]
        return torch.stack(losses).sum()

    def _backward(self, batch: Batch, weight: float) -> torch.Tensor:
        """Backward of `weight` · the batch's loss; that weighted loss, detached."""
        with self._autocast():
            loss = self.loss(batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TrainingError(f"the loss must be a scalar tensor, got {describe(loss)}")
        if weight != 1.0:
            loss = loss * weight
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()  # type: ignore[no-untyped-call]
        return loss.detach()

    @property
    def validates(self) -> bool:
        return self.job.validation_data is not None

    def validation_sums(self, rank: int, world_size: int) -> tuple[dict[str, float], int] | None:
        """This worker's share of the validation data (dealt as the training shards are, so a
        DataLoader with a DistributedSampler is taken as this rank's already), scored on its model
        in eval mode: Σ metric·n per metric, and Σ n; None without validation data."""
        if self.job.validation_data is None:
            return None
        share = rank_share(self.job.validation_data, rank, world_size)
        return metric_sums(self.model, share, validation_metrics(self.job), self.device, self._autocast)

    def averaged(self, averages: Mapping[int, torch.Tensor] | None = None) -> None:
        """This round's average has landed: the outer optimizer, if any, steps from it, or a
        fleet's group smaller than planned takes its share of the way to it (Parts.landing). It
        is in the model, or (overlap_averaging) in `averages` by id(parameter), where the step's
        result goes; a parameter that is not there (in a still group, or in another fragment) does
        not step."""
        landing = self.parts.landing
        if landing is not None:
            landing.step(None if averages is None else [averages.get(id(p)) for p in landing.params])

    def rounds_changed(self, before: int, after: int) -> None:
        """The rounds' k goes from `before` to `after`: the outer optimizer, if any, follows (OuterStep.rounds_changed)."""
        if self.parts.outer is not None:
            self.parts.outer.rounds_changed(before, after)

    def at_step(self, step: int) -> None:
        """The next optimizer step is global step `step`: a per-step schedule goes on to it."""
        if self.schedule is not None:
            self.schedule.at_step(step)

    def landed(self, counters: Counters, score: float, epoch_done: bool) -> None:
        """A round has landed (every worker agrees on `counters` and `score`): the schedule catches up."""
        if self.schedule is not None:
            self.schedule.landed(counters, score, epoch_done, self.validates)

    def after_validation(self, metrics: dict[str, float]) -> bool:
        """A plateau schedule steps on the combined metrics, and early stopping decides on them;
        with restore_best, the best state is kept on the CPU and put back when the fit ends."""
        if self.schedule is not None:
            self.schedule.validated(metrics)
        if self._stopper is None:
            return False
        improved, stop = self._stopper.update(metrics)
        if improved and self._stopper.restore_best:
            self._best = self.state_dicts()
        return bool(stop)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        return autocast(self.config.precision, self.device)

    def clip(self, max_norm: float) -> None:
        """Scale the gradients so that their total norm is at most `max_norm`."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def train_step(self, epoch: int, index: int, batch: Batch) -> tuple[torch.Tensor, int]:
        """AVERAGING's local step: forward, backward and the optimizer's step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, n = self.accumulate(epoch, index, batch)
        self.step()
        return loss, n

    def step(self) -> None:
        """The optimizer's step on the gradients in .grad (SHARED_GRADIENTS: the averaged ones),
        after the user's `before_step(model, optimizer)` and then clipping, so that the clipping
        bound holds whatever the function did. With 16-mixed the gradients are unscaled first,
        and a step the scaler skips (inf or NaN gradients) still counts: the worker stays in its
        round, and in step with the others."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.job.before_step is not None:
            self.job.before_step(self.model, self.optimizer)
        if self.config.gradient_clipping is not None:
            self.clip(self.config.gradient_clipping)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.local_steps += 1

    def checked_loss(self, losses: list[torch.Tensor], first_step: int, epoch: int) -> tuple[float, bool]:
        """Σ loss·n of a round (one device sync per round), and whether NanPolicy.SKIP drops it;
        with NanPolicy.RAISE a non-finite loss is a TrainingError naming the step."""
        if not losses:
            return 0.0, False
        stacked = torch.stack(losses)  # (steps,)
        total = float(stacked.sum())
        if math.isfinite(total):
            return total, False
        if self.config.nan_policy is NanPolicy.SKIP:
            return 0.0, True
        bad = int((~torch.isfinite(stacked)).nonzero()[0])
        what = "learning rate"
        if self.parts.outer is not None:  # its momentum compounds over rounds: short rounds amplify it most
            what = "learning rate or the outer optimizer's (DiLoCo's outer lr 0.7 and momentum 0.9 suit rounds of hundreds of steps)"
        raise TrainingError(
            f"loss is {float(stacked[bad])} at local step {first_step + bad} (epoch {epoch}); lower the "
            f"{what}, or use .nan_policy('skip') to drop such a worker from its round",
            Where(epoch, -1, first_step + bad),
        )

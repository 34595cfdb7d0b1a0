"""One stage of a worker's pipeline, in a process of its own: its groups, its batches, its part of the schedule.

Its batches come from its pipeline's first stage.

Process p is stage p % S of worker p // S. Two kinds of groups, made by every process in the same
order (`new_group` is collective over the world):
- stage s of every worker: the round protocol averages each stage's own state in it, as the
  workers' whole state is averaged without a pipeline;
- the S stages of one worker: activations forward and gradients backward between neighbours, by
  `torch.distributed.pipelining` (GPipe or 1F1B, Huang et al. 2019; Narayanan et al. 2019; or
  zero bubble's V, Qi et al. 2024, where each stage holds two pieces of the model, the first
  stage the first and the last, and the backward of a piece is split into its inputs' gradients,
  which the stage before waits for, and its weights', which fill the bubbles).
Each batch is cut into M equal microbatches (fewer, for a batch size that M does not divide:
`microbatches`); the schedule scales the gradients by 1/M, so that a step on M microbatches of
the mean loss is the step on the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from ..batches import move_to
from ..config import Config, Pipeline
from ..evaluation import scored_outputs, validation_of
from ..feed.protocols import END, BatchSource, EndOfEpoch
from ..feed.shard import rank_share
from ..hooks import Hooks
from ..job import Job
from ..types import Batch, Output, TrainingState
from ..worker import Replica
from .split import Layout, Names, held, joined, pieces_in, pieces_of, scorer, stage_state

Schedule = PipelineScheduleSingle | PipelineScheduleMulti  # torch's: one piece a stage, or several (zbv)
LossFn = Callable[..., torch.Tensor]  # the job's loss function: (outputs, targets) -> loss


@dataclass(frozen=True)
class Position:
    """Where a process sits: stage `stage` of worker `worker`'s pipeline of `stages`."""

    worker: int
    stage: int
    stages: int

    @staticmethod
    def of(process: int, stages: int) -> Position:
        return Position(process // stages, process % stages, stages)

    @property
    def first(self) -> int:
        """The process of this pipeline's first stage."""
        return self.worker * self.stages


def join_groups(position: Position, workers: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this stage's averaging group, this worker's pipeline group)."""
    s = position.stages
    by_stage = [dist.new_group([w * s + stage for w in range(workers)]) for stage in range(s)]
    by_worker = [dist.new_group([w * s + stage for stage in range(s)]) for w in range(workers)]
    return by_stage[position.stage], by_worker[position.worker]


class RelaySource:
    """The batches a pipeline's stages take, the same in the same order: the first stage takes
    each from `source` (the worker's queue or shard) and sends on its index and targets (the last
    stage computes the loss on them; the others count the samples), or the end of the epoch."""

    def __init__(self, source: BatchSource | None, position: Position, group: dist.ProcessGroup) -> None:
        self._source, self._position, self._group = source, position, group

    def epoch_length(self, epoch: int) -> int | None:
        return None  # only the first stage holds the source: every stage must cut rounds alike

    def next_batch(self) -> tuple[int, Batch] | EndOfEpoch:
        item = self._source.next_batch() if self._source is not None else END
        message: list[tuple[int, object] | None] = [None if isinstance(item, EndOfEpoch) else (item[0], item[1][1])]
        dist.broadcast_object_list(message, src=self._position.first, group=self._group)
        if self._source is not None:
            return item
        return END if message[0] is None else (message[0][0], (None, message[0][1]))


class StageReplica(Replica):
    """A worker's replica that holds one stage of the model (`model`, from split.stage_module:
    one piece of it, or two) and its optimizer, and steps by the pipeline schedule. It loads and
    gives its part of the whole model's state, so hosts and checkpoints see whole states
    (`whole`: how the whole model's optimizers lay theirs out)."""

    def __init__(self, model: torch.nn.Module, job: Job, config: Config, device: torch.device, rank: int, world_size: int, *,
                 position: Position, pipe: dist.ProcessGroup, whole: Layout, hooks: Hooks | None = None) -> None:  # fmt: skip
        super().__init__(model, job, config, device, rank, world_size, hooks=hooks)
        assert config.pipeline is not None and job.loss_fn is not None  # pipeline.check, at build()
        self.position, self.pipe, self.whole, self.spec = position, pipe, whole, config.pipeline
        self.pieces = pieces_in(self.model)
        self.scores = position.stage == scorer(self.spec)  # this stage computes the loss
        self._scorer = dist.get_global_rank(pipe, scorer(self.spec))
        self._schedules: dict[int | tuple[str, int], Schedule] = {}  # by batch size (forward only: ("forward", size)): a stage's buffers are shaped at its first step

    def load_state(self, state: TrainingState) -> None:
        super().load_state(stage_state(state, self.whole.names, self.model, self.optimizer))

    def clip(self, max_norm: float) -> None:
        """Clip by the whole model's gradient norm, as one process would: each stage's squared
        norm, summed over the pipeline, then the same scale on every stage
        (torch.nn.utils.clip_grad_norm_'s, with its 1e-6)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norms = [torch.linalg.vector_norm(g.detach()) for g in grads]
        squared = torch.stack(norms).square().sum() if norms else torch.zeros((), device=self.device)
        dist.all_reduce(squared, group=self.pipe)
        scale = torch.clamp(max_norm / (squared.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(scale.to(g.dtype))

    def saved_state(self, writes: bool) -> TrainingState | None:
        """What a checkpoint holds: worker 0's whole state, its stages' parts gathered and joined
        on the process that `writes` (its first stage) only. Every stage of worker 0 takes part."""
        if self.position.worker != 0:
            return None
        parts = cast("list[tuple[TrainingState, Names]]", [None] * self.position.stages) if writes else None  # gather_object fills each
        dist.gather_object(self.part(), parts, dst=self.position.first, group=self.pipe)
        return None if parts is None else self.joined(parts)

    def whole_state(self) -> TrainingState:
        """The whole model's state, on every stage of this pipeline: each stage's part, gathered
        over the pipeline's group and joined."""
        parts = cast("list[tuple[TrainingState, Names]]", [None] * self.position.stages)  # all_gather_object fills each
        dist.all_gather_object(parts, self.part(), group=self.pipe)
        return self.joined(parts)

    def part(self) -> tuple[TrainingState, Names]:
        """This stage's state and its parameters' names, for `joined` on another stage."""
        return self.state_dicts(), Names.of(self.model, self.optimizer)

    def joined(self, parts: list[tuple[TrainingState, Names]]) -> TrainingState:
        """The whole model's state from every stage's `part`, in stage order."""
        return joined([state for state, _ in parts], [names for _, names in parts], self.whole)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """This stage's part of the schedule on the batch's microbatches, and the batch's mean
        loss, which the last stage computes and sends to the others: every stage then reports the
        same scores and takes the same NaN decisions."""
        inputs, targets = batch
        schedule = self._schedule(int(targets.shape[0]))
        losses: list[torch.Tensor] = []
        with self._autocast():
            step(schedule, self.spec, self.position.stage, inputs, targets, losses)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self._scorer, group=self.pipe)
        return loss

    @torch.no_grad()
    def validation_sums(self, rank: int, world_size: int) -> tuple[dict[str, float], int] | None:
        """The default validation (val_loss, val_accuracy) of this worker's share, in eval mode, by
        a forward-only pass of the pipeline: the last stage scores the outputs and sends the sums
        to the others, so that every stage reports the same metrics."""
        if self.job.validation_data is None:
            return None
        sums: dict[str, float] = {}
        count = 0
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in rank_share(self.job.validation_data, rank, world_size):
                inputs, targets = move_to(batch, self.device)
                n = int(targets.shape[0])
                with self._autocast():  # as the unsplit validation scores, precision and all
                    outputs = self._forward(inputs, n)
                    metrics = validation_of(scored_outputs(outputs, targets, self.job.loss_fn)) if self.scores else {}
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * n
                count += n
        finally:
            self.model.train(was_training)
        message = [sums]
        dist.broadcast_object_list(message, src=self._scorer, group=self.pipe)
        return message[0], count

    def _forward(self, inputs: Batch, n: int) -> Output | None:
        """Forward only, through the pipeline, of a batch of `n` (`inputs` on the first stage):
        the outputs on the stage that scores, None on the others."""
        if len(self.pieces) > 1:
            return self._down_and_up(inputs)
        key = ("forward", n)
        if key not in self._schedules:  # a GPipe schedule without a loss runs forwards only
            (stage,) = pipeline_stages(self.pieces, self.spec, self.position.stage, self.device, self.pipe)
            self._schedules[key] = ScheduleGPipe(stage, microbatches(n, self.spec.microbatches))
        forward = self._schedules[key]
        return forward.step(inputs) if self.position.stage == 0 else forward.step()

    def _down_and_up(self, inputs: Batch) -> Output | None:
        """Forward only through the V of "zbv"'s pieces, the whole batch at once (torch's V
        schedule runs no forward without a backward): each piece, on the stage that holds it,
        takes the activations from the one before and sends its own on. The outputs end on the
        first stage, which holds the last piece."""
        spec, me = self.spec, self.position.stage
        owner = [next(s for s in range(spec.stages) if piece in held(spec, s)) for piece in range(pieces_of(spec))]
        mine = dict(zip(held(spec, me), self.pieces))
        x = inputs
        for piece in sorted(mine):
            if piece > 0 and owner[piece - 1] != me:
                x = self._receive(owner[piece - 1])
            x = mine[piece](x)
            if piece + 1 < len(owner) and owner[piece + 1] != me:
                self._send(x, owner[piece + 1])
        return x if self.scores else None

    def _send(self, x: object, stage: int) -> None:
        if not isinstance(x, torch.Tensor):
            where = f"a piece on stage {self.position.stage} returned a {type(x).__name__} in validation"
            raise TypeError(f"pipeline(schedule='zbv'): {where}; each piece must return one tensor: cut elsewhere (split=...) or use schedule='1f1b'")
        to = dist.get_global_rank(self.pipe, stage)
        dist.send_object_list([(tuple(x.shape), x.dtype)], dst=to, group=self.pipe, device=self.device)
        dist.send(x.contiguous(), dst=to, group=self.pipe)

    def _receive(self, stage: int) -> torch.Tensor:
        source = dist.get_global_rank(self.pipe, stage)
        shape = cast("list[tuple[tuple[int, ...], torch.dtype]]", [None])  # recv_object_list fills it
        dist.recv_object_list(shape, src=source, group=self.pipe, device=self.device)
        x = torch.empty(shape[0][0], dtype=shape[0][1], device=self.device)
        dist.recv(x, src=source, group=self.pipe)
        return x

    def _schedule(self, n: int) -> Schedule:
        if n not in self._schedules:
            stages = pipeline_stages(self.pieces, self.spec, self.position.stage, self.device, self.pipe)
            self._schedules[n] = training_schedule(stages, self.spec, microbatches(n, self.spec.microbatches), self.job.loss_fn)
        return self._schedules[n]


def pipeline_stages(pieces: list[torch.nn.Module], spec: Pipeline, stage: int, device: torch.device, group: dist.ProcessGroup | None) -> list[PipelineStage]:
    """torch's PipelineStage of each piece that stage `stage` holds (split.pieces_in), in order."""
    return [PipelineStage(piece, i, pieces_of(spec), device, group=group) for piece, i in zip(pieces, held(spec, stage))]


def training_schedule(stages: list[PipelineStage], spec: Pipeline, m: int, loss_fn: LossFn | None) -> Schedule:
    """The schedule `spec` names, over a stage's PipelineStages, for batches of `m` microbatches.
    With fewer microbatches than stages, 1F1B's warm-up takes them all: it is GPipe, which torch's
    Schedule1F1B refuses to run, so GPipe runs it."""
    if spec.schedule == "zbv":
        return pipelining.ScheduleZBVZeroBubble(list(stages), m, loss_fn=loss_fn)
    kind = Schedule1F1B if spec.schedule == "1f1b" and m >= spec.stages else ScheduleGPipe
    return kind(stages[0], m, loss_fn=loss_fn)


def step(schedule: Schedule, spec: Pipeline, stage: int, inputs: Batch, targets: object, losses: list[torch.Tensor] | None = None) -> None:
    """Stage `stage`'s part of one batch through `schedule`: the first stage gives the inputs, the
    one that scores the targets (and gets the microbatches' losses in `losses`)."""
    given = (inputs,) if stage == 0 else ()
    if stage == scorer(spec):
        schedule.step(*given, target=targets, losses=losses)
    else:
        schedule.step(*given)


def microbatches(n: int, most: int) -> int:
    """How many microbatches a batch of `n` samples is cut into: the most, up to `most`, that cut
    it into equal parts. A stage shapes its buffers at its first microbatch, so a smaller last one
    would not fit them; and the mean of equal parts' mean losses is the batch's mean loss."""
    return max(m for m in range(1, min(n, most) + 1) if n % m == 0)



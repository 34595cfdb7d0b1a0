"""A model cut into pipeline stages, and a fit's state cut and joined along the same lines.

A model can be cut when its forward is its layers applied in order: an `nn.Sequential`, or a
module that lists such layers in `pipeline_layers()` (models.LeNet does). It is cut into pieces
of consecutive layers: one a stage, or two with the "zbv" schedule (`held`). A
stage's module holds its layers under their own names, so its state-dict keys are the whole
model's: a stage's state is the whole model's restricted to its keys, and rank 0's stages
together are the whole model's state again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import Pipeline
from ..job import Job
from ..rounds.state import trained_parameters
from ..types import StateDict, TrainingState

_HINT = "give an nn.Sequential, or a module whose pipeline_layers() returns its (name, layer) pairs in forward order"


def layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's (name, layer) pairs in forward order; a ValueError when it has none, or holds
    parameters outside them (they would be on no stage)."""
    listed = getattr(model, "pipeline_layers", None)
    if callable(listed):
        pairs = list(listed())
    elif isinstance(model, torch.nn.Sequential):
        pairs = list(model.named_children())
    else:
        raise ValueError(f"pipeline: {type(model).__name__} cannot be cut into stages: its forward is not a list of layers; {_HINT}")
    held = {id(p) for _, layer in pairs for p in layer.parameters()}
    outside = [name for name, p in model.named_parameters() if id(p) not in held]
    if outside:
        raise ValueError(f"pipeline: parameters {outside[:3]} of {type(model).__name__} are in none of its layers, so no stage would hold them; {_HINT}")
    return pairs


def boundaries(model: torch.nn.Module, stages: int, split: Sequence[str] | None, what: str = "stage") -> list[int]:
    """The index of each of `stages` pieces' first layer (piece 0's is 0): at the layers `split`
    names, or, with None, where the parameter count passes each s/S of the whole. A ValueError
    when a piece would be empty or a name is not a layer of the model, in order; `what` names a
    piece in it."""
    pairs = layers(model)
    names = [name for name, _ in pairs]
    if split is not None:
        if len(split) != stages - 1:
            raise ValueError(f"pipeline: split names the layers where {what}s 1..{stages - 1} begin, {stages - 1} names, got {len(split)}: {list(split)}")
        unknown = [name for name in split if name not in names]
        if unknown:
            raise ValueError(f"pipeline: split names {unknown}, which are not layers of {type(model).__name__}; its layers are {names}")
        starts = [0, *(names.index(name) for name in split)]
    else:
        counts = [sum(p.numel() for p in layer.parameters()) for _, layer in pairs]
        prefix = [sum(counts[:i]) for i in range(len(pairs) + 1)]  # parameters before layer i
        trained = [sum(any(p.requires_grad for p in layer.parameters()) for _, layer in pairs[:i]) for i in range(len(pairs) + 1)]
        starts = [0]
        for j in range(1, stages):
            # piece j begins at the cut nearest to j/S of the parameters, of those that leave a
            # trained layer to the piece before and one to each piece after
            cuts = [i for i in range(starts[-1] + 1, len(pairs)) if trained[i] > trained[starts[-1]] and trained[-1] - trained[i] >= stages - j]
            if cuts:
                starts.append(min(cuts, key=lambda i: abs(prefix[i] - prefix[-1] * j / stages)))
    ends = [*starts[1:], len(pairs)]
    empty = [s for s, (a, b) in enumerate(zip(starts, ends)) if b <= a or not any(p.requires_grad for _, layer in pairs[a:b] for p in layer.parameters())]
    if len(starts) < stages or empty:
        where = f"split={list(split)}" if split is not None else "an equal parameter count"
        raise ValueError(
            f"pipeline: {where} leaves {what} {empty[0] if empty else len(starts)} of {stages} with no trained layer "
            f"({len(pairs)} layers: {names}); use fewer stages, or name split points in order, each after the last"
        )
    return starts


def pieces_of(spec: Pipeline) -> int:
    """How many pieces the model is cut into: one a stage, or two with "zbv"."""
    return 2 * spec.stages if spec.schedule == "zbv" else spec.stages


def held(spec: Pipeline, stage: int) -> tuple[int, ...]:
    """The pieces that stage `stage` holds, in forward order: its own; with "zbv", pieces s and
    2S - 1 - s, so that the model goes down the stages and back up (a V), and the first stage
    holds the last piece too."""
    return (stage, pieces_of(spec) - 1 - stage) if spec.schedule == "zbv" else (stage,)


def scorer(spec: Pipeline) -> int:
    """The stage that holds the model's last piece, and computes the loss."""
    return 0 if spec.schedule == "zbv" else spec.stages - 1


def cut(model: torch.nn.Module, spec: Pipeline) -> list[int]:
    """`boundaries` of the pieces `spec` cuts the model into; a ValueError where it cannot."""
    if pieces_of(spec) == spec.stages:
        return boundaries(model, spec.stages, spec.split)
    try:
        return boundaries(model, pieces_of(spec), spec.split, "piece")
    except ValueError as error:
        raise ValueError(f"{error} (with schedule='zbv' each of the {spec.stages} stages holds two pieces)") from None


def stage_module(model: torch.nn.Module, spec: Pipeline, stage: int) -> torch.nn.Module:
    """Stage `stage` of the model: an nn.Sequential of its layers, under their own names; or,
    holding two pieces, `Pieces`."""
    pairs, starts = layers(model), cut(model, spec)
    ends = [*starts[1:], len(pairs)]
    parts = [pairs[starts[i] : ends[i]] for i in held(spec, stage)]
    if len(parts) == 1:
        return torch.nn.Sequential(OrderedDict(parts[0]))
    return Pieces(parts)


def pieces_in(stage: torch.nn.Module) -> list[torch.nn.Module]:
    """The pieces of the model a `stage_module` holds, each a module the schedule runs."""
    return list(stage.pieces()) if isinstance(stage, Pieces) else [stage]


class Pieces(torch.nn.ModuleDict):
    """A stage that holds pieces of the model that do not follow each other (with the "zbv"
    schedule): their layers under their own names, and `pieces()`, an nn.Sequential a piece,
    which the schedule runs each on its own. It has no forward of its own."""

    def __init__(self, pieces: list[list[tuple[str, torch.nn.Module]]]) -> None:
        super().__init__(OrderedDict(pair for piece in pieces for pair in piece))
        self.sizes = [len(piece) for piece in pieces]

    def pieces(self) -> list[torch.nn.Sequential]:
        pairs, out, start = list(self.items()), [], 0
        for size in self.sizes:
            out.append(torch.nn.Sequential(OrderedDict(pairs[start : start + size])))
            start += size
        return out


@dataclass(frozen=True)
class Names:
    """A model's parameter names by the index its optimizers' state dicts number them: the
    optimizer's (in its groups' order) and the outer optimizer's (the trained parameters, in the
    model's order: rounds.state.trained_parameters)."""

    optimizer: list[str]
    trained: list[str]

    @staticmethod
    def of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Names:
        name_of = {id(p): name for name, p in model.named_parameters()}
        return Names(
            [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]],
            [name_of[id(p)] for p in trained_parameters(model, optimizer)],
        )


def stage_state(whole: TrainingState, whole_names: Names, stage: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingState:
    """The part of the whole model's state that `stage` (trained by `optimizer`) holds. The
    optimizers' per-parameter state goes by name; their groups' settings are the whole's (a
    stage's groups are the whole's groups, each restricted to the stage's parameters)."""
    keys = stage.state_dict().keys()
    mine = Names.of(stage, optimizer)
    groups = [len(g["params"]) for g in optimizer.param_groups]
    inner = _cut(whole.optimizer, whole_names.optimizer, mine.optimizer, groups)
    outer = None if whole.outer_optimizer is None else _cut(whole.outer_optimizer, whole_names.trained, mine.trained, [len(mine.trained)])
    return TrainingState({k: v for k, v in whole.model.items() if k in keys}, inner, whole.lr_scheduler, outer)


def _cut(whole: StateDict, whole_names: list[str], names: list[str], sizes: list[int]) -> StateDict:
    """An optimizer's state dict restricted to the parameters `names` (numbered as the stage's
    optimizer numbers them, in groups of `sizes`), from the whole's (numbered by `whole_names`).
    Each group's settings are those of the whole's group that holds its first parameter."""
    by_name = {whole_names[i]: s for i, s in whole["state"].items()}
    settings = {whole_names[i]: {k: v for k, v in g.items() if k != "params"} for g in whole["param_groups"] for i in g["params"]}
    groups, start = [], 0
    for size in sizes:
        groups.append({**settings[names[start]], "params": list(range(start, start + size))})
        start += size
    return {"state": {i: by_name[name] for i, name in enumerate(names) if name in by_name}, "param_groups": groups}


def _join(parts: list[StateDict], names: list[list[str]], whole_names: list[str], whole_groups: list[StateDict]) -> StateDict:
    """The whole optimizer's state dict (numbered by `whole_names`, in `whole_groups`) from its
    stages' (each numbered by its `names`). Each group's settings are as the stages left them (a
    schedule moves the learning rate), found by the group's first parameter, which is the first
    of a stage's group too."""
    by_name = {n[i]: s for part, n in zip(parts, names) for i, s in part["state"].items()}
    settings = {n[g["params"][0]]: g for part, n in zip(parts, names) for g in part["param_groups"] if g["params"]}
    groups = [{**settings.get(whole_names[g["params"][0]], g), "params": g["params"]} if g["params"] else g for g in whole_groups]
    return {"state": {i: by_name[name] for i, name in enumerate(whole_names) if name in by_name}, "param_groups": groups}


@dataclass(frozen=True)
class Layout:
    """How the whole model's optimizers lay out their state: its parameters' names, and the
    optimizer's groups (settings and indices, no state). A stage's process keeps it to join its
    pipeline's parts without the whole model."""

    names: Names
    groups: list[StateDict]  # the optimizer state dict's param_groups
    keys: list[str]  # the model's state-dict keys, in its order

    @staticmethod
    def of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Layout:
        return Layout(Names.of(model, optimizer), optimizer.state_dict()["param_groups"], list(model.state_dict()))


def joined(parts: list[TrainingState], names: list[Names], whole: Layout) -> TrainingState:
    """The whole model's state from its stages' (a worker's, in stage order, each numbered by
    its `names`). (The outer optimizer has one group, over every trained parameter: outer.OuterStep.)"""
    held = {k: v for part in parts for k, v in part.model.items()}
    model = {k: held[k] for k in whole.keys if k in held}
    inner = _join([p.optimizer for p in parts], [n.optimizer for n in names], whole.names.optimizer, whole.groups)
    outer = None
    if parts[0].outer_optimizer is not None:
        one_group = [{"params": list(range(len(whole.names.trained)))}]
        outer = _join([p.outer_optimizer for p in parts if p.outer_optimizer is not None], [n.trained for n in names], whole.names.trained, one_group)
    return TrainingState(model, inner, parts[0].lr_scheduler, outer)


def joined_state(parts: list[TrainingState], job: Job, spec: Pipeline) -> TrainingState:
    """`joined`, for stages cut from `job`'s model as `spec` says, laid out as the optimizers that
    `job` makes for the whole model lay their states out."""
    stages = [stage_module(job.model, spec, s) for s in range(spec.stages)]
    names = [Names.of(stage, job.make_optimizer(stage)) for stage in stages]
    return joined(parts, names, Layout.of(job.model, job.make_optimizer(job.model)))  # no state yet: a few lists of parameters

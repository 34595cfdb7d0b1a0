"""Checkpoints: save a run at a round boundary and resume it exactly.

A checkpoint is one file, `checkpoint.pt` in the checkpoint directory. Rank 0 writes it every
`checkpoint_every` rounds, at the end of every epoch, and when training is stopped (Ctrl-C). It
is written to a temporary file in the same directory, flushed to disk and renamed over the old
one, so a crash while saving leaves the last good checkpoint whole.

The file is a `torch.save`d dict:

    format       1
    fingerprint  what must match to resume: the options declared with fingerprint=True (those
                 that change the arithmetic: workers, averaging_frequency, training_mode, ...),
                 each only where not at its default, how the features split the own states
                 (a pipeline's stages: feature.Feature.fingerprint), the optimizer class
                 and arguments, the scheduler's, the outer optimizer's, and every parameter and
                 buffer's name, shape, dtype
    config       the whole config, for people
    model        the averaged model's state_dict
    optimizer    the optimizer's state_dict (averaged; worker 0's with average_updaters(False))
    lr_scheduler the schedule's state (schedule.Schedule), or None without .lr_scheduler(...)
    outer_optimizer  the outer optimizer's state_dict, or None without .outer_optimizer(...)
    counters     rounds, iterations, samples, epoch, position (batches of `epoch` already trained)
    rng          each worker's own state, by rank (by process with a pipeline: stage s of worker
                 w is w·S + s): its torch RNG state (and CUDA's), with
                 precision 16-mixed its GradScaler's, with gradient encoding its residual, τ
                 and the encoded steps (threshold.Residual)

Resuming restores all of it; the feed skips the `position` batches of the epoch already trained.
The file is read with `torch.load(weights_only=True)`: tensors and plain values only, so a file
that would run code as it loads is refused, and resuming from someone else's checkpoint runs
nothing of theirs.
With the deterministic feed, an interrupted and resumed run ends bitwise equal to one that was
never interrupted.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .config import Config, describe_config
from .job import Job
from .naming import short
from .registry import declared
from .types import Counters, TrainingState

FILENAME = "checkpoint.pt"
FORMAT = 1
# The options a resumed run must match (those declared with fingerprint=True), and their defaults:
# a key a fingerprint lacks is an option at its default (as checkpoints from before it have it).
_FINGERPRINTED = {d.name: d.default for d in declared(Config) if d.option.fingerprint}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: missing, corrupt, or from another model or config."""


def fingerprint(config: Config, job: Job, world_size: int, split: Mapping[str, object] | None = None) -> dict[str, object]:
    """What a resume must match. `split`: how the config's features split the own states
    (feature.Feature.fingerprint: a pipeline's are by process)."""
    options = {k: v for k, v in describe_config(config).items() if k in _FINGERPRINTED and getattr(config, k) != _FINGERPRINTED[k]}
    options["workers"] = world_size
    options.update(split or {})
    return {
        **options,
        "optimizer": job.optimizer_name,
        "lr_scheduler": None if job.lr_scheduler is None else job.lr_scheduler.name,  # absent before schedules
        "outer_optimizer": None if job.outer_optimizer is None else job.outer_optimizer.name,
        "tensors": [(k, list(v.shape), str(v.dtype)) for k, v in job.model.state_dict().items()],
    }


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def path_of(location: str | os.PathLike[str]) -> Path:
    """A checkpoint file, given it or the directory holding it."""
    path = Path(location)
    return path / FILENAME if path.is_dir() else path


def save(directory: str | os.PathLike[str], payload: dict[Any, Any], name: str = FILENAME) -> Path:
    """Write `name` (the checkpoint, or a file beside it: feed/order.py's) atomically: a temporary
    file, fsync, rename over the old one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    fd, tmp = tempfile.mkstemp(prefix=f".{Path(name).stem}-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _read(location: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint file and its contents; any missing, unreadable or foreign file is a
    CheckpointError naming it. Only tensors and plain values are read (`weights_only=True`): a
    file that would run code or build other objects as it loads is refused, so resuming from a
    checkpoint someone else gave you runs nothing of theirs."""
    path = path_of(location)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: pass the checkpoint directory or its {FILENAME}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        detail = str(e).splitlines()[0][:300]
        raise CheckpointError(
            f"{path} holds more than tensors and plain values, and checkpoints are read without running "
            f"any code in them: not resumed ({detail})"
        ) from e
    except Exception as e:  # any unreadable file is the same error to the user
        raise CheckpointError(f"{path} is not a readable checkpoint: {type(e).__name__}: {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a parallelwrapper checkpoint of format {FORMAT}")
    return path, payload


# What a user may resume across, naming it: these rebuild from this run's own code and load the
# checkpoint's state as any later fit() would; and the number of workers, whose own states are
# then resized (`own_states`). The rest shapes the state itself or the rounds.
ACCEPTABLE = ("optimizer", "lr_scheduler", "outer_optimizer", "workers")
_PER_WORKER = ("codec_errors",)  # own state that is one worker's alone: what it has yet to send


def own_states(saved: list[dict[str, Any]], workers: int, per_worker: int = 1) -> list[dict[str, Any]]:
    """A checkpoint's own states (one a process: `per_worker` processes a worker, a pipeline's
    stages) for `workers` workers, where it was written with another number of them (torchrun's
    `--nnodes MIN:MAX` restarting with a machine fewer or more). Worker w < its count keeps its
    own; the others' are dropped, and with them what each had yet to send (a coded payload's error
    fed back, a gradient encoding's residual: a part of a round's change). A worker beyond them
    starts from worker 0's, with nothing yet to send and an RNG of its own (drawn from worker 0's,
    so a resume draws the same). The policy's state is every worker's alike."""
    had = len(saved) // per_worker
    out = list(saved[: min(had, workers) * per_worker])
    for w in range(had, workers):
        for s in range(per_worker):
            own = {k: v for k, v in saved[s].items() if k not in (*_PER_WORKER, "cuda")}  # CUDA's RNG: the process's own
            if "gradient_encoding" in own:
                own["gradient_encoding"] = {**own["gradient_encoding"], "residual": torch.zeros_like(own["gradient_encoding"]["residual"])}
            generator = torch.Generator()
            generator.set_state(own["torch"])
            seed = int(torch.randint(0, 2**62, (1,), generator=generator)) + w
            own["torch"] = torch.Generator().manual_seed(seed).get_state()
            out.append(own)
    return out


def load(location: str | os.PathLike[str], expected: dict[str, object], accept: Iterable[str] = ()) -> dict[str, Any]:
    """Read and check a checkpoint against this run's fingerprint; raise naming every mismatch
    that is not in `accept` (fields of ACCEPTABLE the user knows changed harmlessly)."""
    accept = set(accept)
    unknown = sorted(accept - set(ACCEPTABLE))
    if unknown:
        raise ValueError(f"fit(accept_changes=...): {unknown} cannot be accepted; only {list(ACCEPTABLE)} can (the rest shape the saved state)")
    path, payload = _read(location)
    found = payload["fingerprint"]
    # A key either side lacks is an option at its default: compared both ways, a change to or from it shows.
    keys = [*expected, *(key for key in found if key not in expected)]
    differing = [key for key in keys if _value(found, key) != _value(expected, key) and key not in accept]
    if differing:
        lines = [f"{key}: checkpoint has {_said(found, key)}, this run has {_said(expected, key)}" for key in differing]
        fields = [key for key in differing if key in ACCEPTABLE]
        anyway = (
            f"; if you know the change is harmless, resume anyway with fit(..., resume=..., accept_changes={fields})"
            if fields == differing else ""
        )
        raise CheckpointError(
            f"{path} belongs to another model or configuration ({', '.join(differing)} differ{'s' if len(differing) == 1 else ''}); "
            f"resume with the same ones, or start afresh without resume{anyway}:\n  " + "\n  ".join(lines)
        )
    return payload


def _value(fingerprint: dict[str, object], key: str) -> object:
    """A fingerprint's value for `key`, an option it leaves out being at its default."""
    default = _FINGERPRINTED.get(key)
    return fingerprint.get(key, default.value if isinstance(default, enum.Enum) else default)


def _said(fingerprint: dict[str, object], key: str) -> str:
    return short(repr(fingerprint[key])) if key in fingerprint else "the default"


def checkpoint_counters(location: str | os.PathLike[str]) -> dict[str, int]:
    """The counters of a checkpoint (where a resumed run starts), its fingerprint unchecked."""
    counters: dict[str, int] = _read(location)[1]["counters"]
    return counters


class Checkpointer:
    """Writes a round's state (rounds/ decides when, gathers every worker's RNG state and has
    rank 0 call `save`)."""

    def __init__(self, directory: str, every: int, fingerprint: dict[str, object], config: dict[str, object]) -> None:
        """`config`: the whole config as `describe_config` gives it, which every checkpoint holds."""
        self.directory, self.every, self.fingerprint, self.config = directory, every, fingerprint, config

    def due(self, rounds: int) -> bool:
        """Whether a periodic checkpoint falls at the end of round number `rounds`."""
        return rounds % self.every == 0

    def save(self, state: TrainingState, counters: Counters, rng: list[Any]) -> None:
        save(
            self.directory,
            {
                "format": FORMAT,
                "fingerprint": self.fingerprint,
                "config": self.config,
                "model": state.model,
                "optimizer": state.optimizer,
                "lr_scheduler": state.lr_scheduler,
                "outer_optimizer": state.outer_optimizer,
                "counters": dataclasses.asdict(counters),
                "rng": rng,
            },
        )


def make_checkpointer(config: Config, job: Job, world_size: int, split: Mapping[str, object] | None = None) -> Checkpointer | None:
    """The checkpointer `.checkpoint(directory)` asks for, or None (`split`: as `fingerprint`'s)."""
    if config.checkpoint_dir is None:
        return None
    return Checkpointer(config.checkpoint_dir, config.checkpoint_every, fingerprint(config, job, world_size, split), describe_config(config))

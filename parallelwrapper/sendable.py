"""What a spawned worker process can be sent: everything of the job that it rebuilds must pickle.
Checked at build(), before any process starts, so that a lambda or a local function is named
there with the fix, not found later as a worker's failure to start."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Sized
from typing import cast

from .job import Job


class _NullWriter(io.RawIOBase):
    """Counts nothing, keeps nothing: pickling into it checks picklability without a copy."""

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        return len(cast("Sized", b))  # bytes, or a memoryview: what pickle writes


def check_sendable(job: Job) -> None:
    """Workers are spawned processes: everything they rebuild must pickle."""
    parts: Iterable[tuple[str, object]] = [
        ("model", job.model),
        ("optimizer", job.optimizer_fn or (job.optimizer_cls, job.optimizer_kwargs)),
        ("loss_fn", job.loss_fn),
        ("training_step", job.training_step),
        ("before_step", job.before_step),
        ("lr_scheduler", job.lr_scheduler),
        ("validation data", job.validation_data),
        ("validation_step", job.validation_step),
    ]
    check_pickles(parts)


def check_pickles(parts: Iterable[tuple[str, object]]) -> None:
    """A ValueError naming the first of the (name, object) `parts` that does not pickle, with the fix."""
    for name, obj in parts:
        try:
            pickle.Pickler(_NullWriter(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as e:  # pickle raises many types
            raise ValueError(
                f"{name} cannot be sent to a spawned worker process ({type(e).__name__}: {e}): use a module-level "
                f"function, or functools.partial of one to give it arguments (e.g. lr_lambda=functools.partial("
                f"warmup_cosine, warmup=12, total=256)), not a lambda or local function; define classes at module "
                f"level, and guard the script's entry point with `if __name__ == '__main__':`"
            ) from e


__all__ = ["check_pickles", "check_sendable"]

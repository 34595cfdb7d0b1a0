"""The training data as fit() takes it: an iterable of batches or a function that returns one, read epoch by epoch.

What every transport of the feed reads the user's data by: one epoch at a time (`epoch_iterable`),
checked before a fit (`check_epochs`) and as it is read (`check_epoch_length`); what it raises
meanwhile becomes a `FeedError` that says which epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from torch.utils.data.distributed import DistributedSampler

from ..batches import to_cpu
from ..config import check_int
from ..types import Batch

Batches = Iterable[Batch] | Callable[[], Iterable[Batch]]


def compact(data: Batches) -> Batches:
    """A list or tuple of batches with every tensor in a storage of its own: batches that are views
    of one big tensor (slices of a dataset) would each carry all of it to every spawned worker.
    Other data (a DataLoader, a function) is returned as it is."""
    return [to_cpu(batch) for batch in data] if isinstance(data, (list, tuple)) else data


def epoch_iterable(data: Batches) -> Callable[[], Iterable[Batch]]:
    """A function that yields one epoch of batches. A callable (a generator function, a factory)
    is called once per epoch; an iterable is iterated once per epoch."""
    if callable(data) and not isinstance(data, Iterable):
        return data
    if not isinstance(data, Iterable):
        raise ValueError(
            f"fit() takes an iterable of batches (a DataLoader, a list) or a function returning one, "
            f"got {type(data).__name__}"
        )
    return lambda: data


def check_epochs(data: Batches, epochs: int) -> None:
    check_int("epochs", epochs)
    if isinstance(data, Iterator) and epochs > 1:
        raise ValueError(
            f"fit(epochs={epochs}) got an iterator, which is used up after one epoch; pass a list, "
            f"a DataLoader, or a function that returns a fresh iterator (e.g. the generator function itself)"
        )
    if isinstance(data, Sequence) and len(data) == 0:
        raise ValueError("fit() got an empty iterable: there is nothing to train on")


class FeedError(RuntimeError):
    """The user's iterable raised, or yielded nothing; the message says which epoch."""


def data_raised(error: Exception, epoch: int, count: int) -> FeedError:
    return FeedError(f"the training data raised in epoch {epoch} after {count} batches: {error!r}")


def check_epoch_length(count: int, skip: int, epoch: int) -> None:
    """An epoch of `count` batches, of which a resumed run skips the first `skip`."""
    if count == 0:
        raise FeedError(f"the training data yielded no batches in epoch {epoch}: nothing to train on")
    if count < skip:
        raise FeedError(
            f"the training data yielded {count} batches in epoch {epoch}, but the checkpoint "
            f"resumed from had trained {skip} of them: resume with the same data"
        )


def distributed_sampler(data: Batches) -> DistributedSampler[object] | None:
    """The DistributedSampler of a DataLoader that has one: such data is one rank's share already."""
    sampler = getattr(data, "sampler", None)
    return sampler if isinstance(sampler, DistributedSampler) else None

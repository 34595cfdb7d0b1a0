"""A replacement's new process group: the word that starts it, its members' rendezvous, and its giving up.

A process group cannot take a new member, so every replacement forms a new one, generation g
(the first group is generation 0), under a prefix of its own in the main process's store. Its
members wait for each other there before gloo's rendezvous (`assemble`), and the main process
gives the generation up when a member is lost before every one has come (`abandon`): gloo would
otherwise hold the others for the collective timeout, waiting on a process that will not come.
Which of the two words comes first is decided by the store's counter alone (add, set, wait: what
every c10d store has, etcd's EtcdStore too, which lacks compare_set).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed import PrefixStore, Store, distributed_c10d  # type: ignore[attr-defined]
from torch.distributed.distributed_c10d import _set_pg_timeout

FORM_S = 5.0  # the most a regroup's members wait for each other's gloo addresses once all have come (8 form in 0.02 s)
_GO, _GIVEN_UP = "go", "given up"

# How a worker's process joins a process group: over this store, with this collective timeout.
Join = Callable[[Store, datetime.timedelta], None]


@dataclass(frozen=True)
class Regroup:
    """The main process's word to every worker after a replacement: join process group
    `generation`, take the kept state of worker `source`, and redo its round."""

    generation: int
    source: int
    until_epoch: int
    start: float  # when the fit() began (FitCommand.start): a fresh worker's records count from it too


def join(store: Store, generation: int, members: int, timeout: datetime.timedelta, into: Join) -> None:
    """Join generation `generation` of `members` processes (`store`: the whole store) by `into`:
    once every member has come (or the main process gave the generation up), so that the
    rendezvous that follows waits on live processes only, and for FORM_S at most (a member lost
    in it), after which the collectives get `timeout` again."""
    prefixed = PrefixStore(f"generation-{generation}", store)
    assemble(prefixed, members, generation)
    form(prefixed, timeout, into)


def form(store: Store, timeout: datetime.timedelta, into: Join) -> None:
    """Join a generation's process group by `into` over `store` (its prefix), for FORM_S at most
    (a member lost in it), after which the collectives get `timeout` again."""
    # torch names the default group by its count of groups made, and a join that failed half-way
    # (a member lost as gloo connected) left that count one up with no group made: this member
    # would wait under another name than a fresh process's until the timeout. It holds no group
    # here (a member joins only after it left the last one), so the count starts again at 0.
    distributed_c10d._world.group_count = 0
    into(store, min(timeout, datetime.timedelta(seconds=FORM_S)))
    _set_pg_timeout(timeout)


def assemble(store: Store, members: int, generation: int) -> None:
    """Wait until every one of `members` has come to form generation `generation` (`store` is its
    prefix of the store), or until the main process gave it up (`abandon`): a member lost before it
    came would otherwise hold the others in gloo's rendezvous for the collective timeout."""
    if store.add("arrived", 1) == members:
        _say(store, _GO)  # unless given up first: the first word stays
    store.wait(["formed"])
    if store.get("formed") != _GO.encode():
        raise RuntimeError(f"the main process gave up generation {generation}: a member was lost before every one had come")


def abandon(store: Store, generation: int) -> None:
    """Give up generation `generation` (`store`: the whole store) unless every member came already:
    those waiting in `assemble`, and those yet to come, fail at once and park again."""
    _say(PrefixStore(f"generation-{generation}", store), _GIVEN_UP)


def _say(store: Store, word: str) -> None:
    """Set the generation's word (`store`: its prefix) unless one was said before: the first to
    count 1 on its counter says it, so the word, once said, stays."""
    if store.add("said", 1) == 1:
        store.set("formed", word)


__all__ = ["FORM_S", "Join", "Regroup", "abandon", "assemble", "form", "join"]

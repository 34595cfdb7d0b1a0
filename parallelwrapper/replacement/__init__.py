"""Worker replacement (`.on_worker_failure("replace")`): a lost spawned worker replaced by a fresh process, or a fleet's survivors going on, its round redone.

Two things are kept that the round protocol needs nowhere else, so that a round can be lost and
redone: the state each round starts from, a copy in every worker (keeper.py), and what was fed
since, in the feeder's record of what it put and each worker's ledger of its takes (ledger.py).
On a loss the main process puts the lost round's batches back in the queues (refeed.py), a fresh
process takes the lost rank, and every worker forms a new process group (regroup.py) and redoes
the round from the survivor's copy (replacer.py); docs/design.md, "A lost worker, replaced".

The package's feature object (`Replaces`, feature.Feature, which `of` makes) says what a lost
worker means and what the caller is told. The spawned host asks this package two things more, and
neither imports it nor names its classes (the wrapper hands it what `replacer(config)` gives), and
the package imports nothing of the hosts: it sees the pool as replacer.py's `Pool` and a worker
as keeper.py's `Replaceable`, which they implement:
- in the main process, what `replacer` makes of the config, the placement and the pool: the side (hosts/spawned.py's Replacing) that sizes the slots its workers keep,
  gives each worker's process its share (`worker_side`), hears which reports go on (`passes`),
  calls the workers away at a failure (`call_away`) and replaces the lost worker (`replace`);
- in a worker's process, that share's `taking` (what records the worker's takes from its queue)
  and `survivor`: the worker's side (a keeper), which the round loop tells where each round
  starts (hooks.RoundObserver) and its process asks at a fit's edges and at a loss
  (hosts/process.py's Failover and Survivor protocols).

A fleet's member (hosts/fleet.py) asks it one thing, what `survivor(config)` makes: its part that
outlives a loss (fleet.py), which enrolls it, keeps each round's starting state as the keeper
does (keeper.Keep, which both share, as they share the regroup's forming and the choice of the
newest kept round) and forms the group anew after a loss or to take in a newcomer, with no main
process: the survivors agree in the fleet's store.
"""

from __future__ import annotations

from ..config import Config
from ..feature import Feature, Over
from .fleet import Survivor
from .replacer import Replacer


class Replaces(Over):
    """Replacement as a feature: what a lost spawned worker means (a fresh process in its place),
    told once under a host where it cannot act."""

    def __init__(self, workers: int, fleet: bool, rest: Feature) -> None:
        super().__init__(rest)
        self.workers, self.fleet = workers, fleet

    @property
    def redoes(self) -> bool:
        return True  # wherever the option is set, as the exchange always had it

    def notes(self, torchrun: bool) -> tuple[str, ...]:
        if torchrun and self.fleet:
            here: tuple[str, ...] = ()  # the survivors of a fleet go on (fleet.py)
        elif torchrun:
            here = (
                'under torchrun, on_worker_failure("replace") is ignored: torchrun restarts the group '
                "(--max-restarts) and with .checkpoint(dir) it resumes from the last checkpoint",
            )
        elif self.workers == 1:
            here = ('on_worker_failure("replace") restores a lost worker from a peer, and one worker has none: a failure raises',)
        else:
            here = ()
        return here + self.rest.notes(torchrun)


def of(config: Config, rest: Feature) -> Feature:
    """Replacement over `rest`, when `config` replaces a lost worker."""
    return Replaces(config.workers, config.fleet is not None, rest) if config.on_worker_failure == "replace" else rest


def replacer(config: Config) -> type[Replacer] | None:
    """What makes the main process's side of replacement for a pool of spawned workers (Replacer,
    called with the pool's own parts), or None when `config` does not replace a lost worker."""
    return Replacer if config.on_worker_failure == "replace" else None


def survivor(config: Config) -> type[Survivor] | None:
    """What makes a fleet member's part that outlives a loss (Survivor, called with the member's
    own parts: hosts/fleet.py), or None when `config` does not go on without a lost member."""
    return Survivor if config.on_worker_failure == "replace" else None


__all__ = ["Replaces", "of", "replacer", "survivor"]

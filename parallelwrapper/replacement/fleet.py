"""A fleet's members: they enroll and form their group in the shared store, agree on the next after a loss with no leader, take in a process that joins, and resume or redo the round.

A fleet (`.fleet(store, processes=N)` with `.on_worker_failure("replace")`) is processes launched
apart, a torchrun on each machine, whose group forms in a store that none of them hosts
(hosts/fleet.py; docs/guides/many-machines.md). Each enrolls once (`Survivor`: a number from the
store's counter, its member id for life); generation 0 is the first N, ranked by id. Every member
keeps the state each round starts from (keeper.Keep), and a group forms anew, generation g + 1,
in two cases:
- **A loss.** A peer lost in a collective: every survivor leaves the group and comes to
  generation g + 1 (`regroup`), saying there which round it kept. It waits until every member
  of generation g has come or is gone (its host says: a process that refuses a connection, or
  one silent for `gone_s`): a survivor in its local steps comes at its next collective, a dead
  one never does.
  The first to see the count closed writes the members (the store's `add` says who, as
  regroup._say does: what every c10d store has), and every member reads that list, so all agree
  on it and on the source of the redo, the member that kept the newest round (replacer.newest).
- **A join.** A process that enrolls after the first N says so in the store and waits. At each
  round's start the members agree on the count of those waiting (each proposes what it reads,
  and the first proposal stands: `agreed_joining`); when it has grown, they leave the group
  before training the round (errors.GroupChanges) and form generation g + 1 with the newcomers
  after them (`grow`), which the newcomers wait for. A member lost as that group forms is a loss
  like any other, to the newcomers too (`welcome`).
Both come to generation g + 1 by one rule (`_agree`): the first member to say it writes it, and
every member takes it as written, so that a member which saw a loss while the others grew the
group (a collective that failed for it alone) forms the same group as they do.
What a generation says every round, that agreement and the claims of its batches, goes to a
TCPStore that its rank 0 hosts (`local`), not to the fleet's store: an etcd cluster's writes are
consensus writes, retried under contention (3.3 ms an `add` alone, 7-11 ms with three processes
adding, on this machine's loopback; a 3-machine soak of a small MLP took 10.5 s with its claims in
etcd, 3.2 s with them at rank 0). That store goes with rank 0, and so does its generation.
Then the members form the group (regroup.form) and rebuild their workers for its size. After a
loss they resume the round in flight where they can (`_resumable`): each keeps what it trained in
it, and they claim first the round's batches that none of them trained (the lost members', and
any held for a later round), then go on (feed/claims.Refill), so each batch counts once and a
loss costs the survivors only the lost share of the round, not the round. That needs every
survivor's part of the same round, landed at once and its state left as it was by the failed
exchange (Rounds.progress; a coded payload's change is taken from the round's start again, with
the error its send found: Rounds.starts); else (overlap, whose last round lands in this one; a
round that had begun to land; a grown group, whose newcomers have no part) they receive the
source's kept state (a newcomer's state, from a peer, not from the disk) and redo its round, its
batches claimed again from where it started (feed/claims.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from ..errors import FleetEnded, GroupChanges, WorkerError, summary
from ..messages import FitCommand
from ..types import Counters, Progress, Replacement, Resume
from .keeper import Keep, Replaceable
from .regroup import FORM_S, form
from .replacer import newest

_POLL_S = 0.02  # how often a member waiting in the store looks again
_FORM = datetime.timedelta(seconds=FORM_S)

# How a member joins generation g's process group: over this store, with this timeout, as this rank of this size.
Join = Callable[[Store, datetime.timedelta, int, int], None]


@dataclass(frozen=True)
class Group:
    """Generation `generation` of the fleet's group: its members' ids, rank r is members[r]."""

    generation: int
    members: tuple[int, ...]

    def rank(self, member: int) -> int:
        return self.members.index(member)


class Survivor(Keep):
    """A fleet member's part that outlives a loss: its enrolment and group, the state each round
    starts from (Keep), and the group formed anew after a loss or to take in a newcomer."""

    def __init__(self, store: Store, gone_s: float, timeout: datetime.timedelta, join: Join, rebuild: Callable[[int, int], Replaceable]) -> None:
        """Enroll in `store` (the fleet's keys). A peer silent for `gone_s` is gone; `timeout`: the
        collectives'; `join`: how this member joins a group; `rebuild(rank, size)`: its worker
        anew, for a group of `size` (its host's). `enter` says which group it is in."""
        super().__init__()
        self.store, self.me = store, int(store.add("enrolled", 1)) - 1
        self.group = Group(0, ())
        self._gone_s, self._timeout, self._join, self._rebuild = gone_s, timeout, join, rebuild
        self._gone: Callable[[int], bool] = lambda member: False
        self._watch: Callable[[tuple[int, ...]], None] = lambda members: None
        self._admitted = 0  # newcomers taken in so far, the same on every member
        self._joining = 0  # those waiting, as the members agreed at the round's start
        self._welcomed: bool | None = None  # a newcomer: False until its first fit has taken the fleet's state (`welcome`)
        self._unformed: WorkerError | None = None  # a newcomer's: the loss that its group's forming met (`enter`)
        self._host = ""  # the address its peers reach it at (`enter`)
        self.local: Store | None = None  # the generation's own store, which its rank 0 hosts: every round's keys and claims

    @property
    def rank(self) -> int:
        return self.group.rank(self.me)

    @property
    def generation(self) -> int:
        return self.group.generation

    @property
    def newcomer(self) -> bool:
        """Whether this member joined a running fleet and has yet to take its state: its first fit
        joins the one in progress (`welcome`)."""
        return self._welcomed is False

    def enter(self, processes: int, gone: Callable[[int], bool], watch: Callable[[tuple[int, ...]], None], wait_s: float, host: str) -> tuple[int, int]:
        """(rank, size) of the group this member enters: generation 0 once the first `processes`
        have enrolled, or, enrolled after them, the generation that takes it in; `wait_s` at most.
        `gone(member)`: whether a peer is gone (its process refuses, or it has been silent for
        `gone_s`); `watch(members)`: the peers to watch; `host`: the address its peers reach it at
        (where it hosts its generation's store as rank 0)."""
        self._gone, self._watch, self._host = gone, watch, host
        deadline = time.monotonic() + wait_s
        if self.me < processes:
            while (enrolled := int(self.store.add("enrolled", 0))) < processes:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"member {self.me} waited {wait_s:g} s for the fleet's {processes} processes and {enrolled} enrolled: "
                        "is every machine's torchrun started, with the same .fleet(store, processes=...)?"
                    )
                time.sleep(_POLL_S)
            self.group = Group(0, tuple(range(processes)))
        else:
            self.store.set(f"joiner/{int(self.store.add('joining', 1)) - 1}", str(self.me))
            while self.me not in (group := self._latest(processes)).members:
                if int(self.store.add(f"generation-{group.generation}/left", 0)) >= len(group.members):
                    raise FleetEnded(
                        f"member {self.me} came after the fleet had finished (every member of generation {group.generation} has left): nothing "
                        "is left to train, and this process's model is not the fleet's; end this machine's script (except "
                        "parallelwrapper.FleetEnded), or start a new run under another .fleet(store) name"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"member {self.me} waited {wait_s:g} s to join the running fleet: is it still training?")
                time.sleep(_POLL_S)
            self.group, self._welcomed = group, False
            self._admitted = int(self.store.get(f"generation-{group.generation}/admitted"))
        self._watch(self.group.members)
        try:
            self._enter_group()
        except Exception as e:  # a member lost as the group formed: gloo's refusals, a store's timeout
            if self._welcomed is None:
                raise  # generation 0's: no member has a round to go back to
            # The newcomer's peers regroup without the lost member and wait for it: its first fit
            # does too (`welcome`). The error goes as a line: its frames hold the half-formed group.
            self._unformed = WorkerError(self.rank, f"lost its peers while being taken in (fleet generation {self.generation}): {summary(e)}")
        return self.rank, len(self.group.members)

    def leave(self) -> None:
        """This member leaves the fleet (its host closes): a process that comes to join once every
        member has left is told the fleet has finished."""
        self.store.add(f"generation-{self.generation}/left", 1)

    def attach(self, worker: Replaceable) -> None:
        """This member's worker, built for its group."""
        self.worker = worker

    def welcome(self, until_epoch: int, start: float) -> FitCommand:
        """A newcomer's first fit: the state of the round the fleet redoes with it, from rank 0. A
        member lost as its group formed (`enter`) or before the state reached it is a loss, as in
        `grow`: it regroups with the survivors and takes the state from the one that kept the
        newest round (its peers tell of the loss; it had no round of its own to lose)."""
        self._welcomed, lost, self._unformed = True, self._unformed, None
        if lost is None:
            try:
                kept = self.receive(0)
            except Exception as e:  # noqa: BLE001 - gloo's refusals, a store's timeout: a loss
                lost = self._lost(e, "being taken in")
            else:
                return self.redo(kept, until_epoch, start)
        return self.regroup(lost, until_epoch, start)[0]  # out of the handler: its frames, which hold the group's connections, have gone

    # -- the round loop's events --------------------------------------------------------------------

    def round_starts(self, tag: int, epoch: int, finished: bool, landed: int) -> None:
        """Keep the round's starting state; then agree with the other members on the count of
        processes waiting to join (`agreed_joining`), and leave the round untrained when it has
        grown (GroupChanges, which its host answers: `grow`)."""
        super().round_starts(tag, epoch, finished, landed)
        assert self.local is not None, "a round outside a group"
        self._joining = agreed_joining(self.local, self.store, tag)
        if self._joining > self._admitted:
            raise GroupChanges(f"{self._joining - self._admitted} process(es) join the fleet at round {tag}")

    # -- its host's calls ---------------------------------------------------------------------------

    def grow(self, until_epoch: int, start: float) -> tuple[FitCommand, list[Replacement]]:
        """Take in the processes waiting to join (after GroupChanges): generation g + 1 is this
        group's members, then the newcomers by their order of coming, unless a member that saw a
        loss said the next generation first (`_reform`)."""
        return self._reform(None, until_epoch, start)

    def regroup(self, error: WorkerError, until_epoch: int, start: float) -> tuple[FitCommand, list[Replacement]]:
        """After `error` (a peer lost, seen in a collective): go on without the members lost,
        unless a member that grew the group said the next generation first (`_reform`)."""
        return self._reform(error, until_epoch, start)

    def _reform(self, error: WorkerError | None, until_epoch: int, start: float) -> tuple[FitCommand, list[Replacement]]:
        """Leave the group and form the next with the other members (`_agree`): grown (`error`
        None) or without the members lost (after `error`). Return the fit that redoes the kept
        round that every member takes, with what the caller is told of each member lost (its rank
        in the group it left). A member lost as the group forms, or before the state reached every
        one, is one more loss: they agree on the next generation again."""
        began, first = time.monotonic(), self.group
        # After a loss, this member's part of the round in flight and its state as the loss left
        # it: where every survivor has its part (`_resumable`), they resume the round.
        done = self.worker.rounds.progress() if error is not None else None
        mine = None if done is None else self.worker.replica.state_dicts()
        starts = None if done is None else self.worker.rounds.starts()
        while True:
            if dist.is_initialized():
                dist.destroy_process_group()  # every peer's collective ends at once, once no one holds the group (its host: fleet.py)
                gc.collect()
            self.group, source, grown = self._agree(error)
            self._watch(self.group.members)
            self.attach(self._rebuilt())
            try:
                self._enter_group()
                refill = None if grown else self._resumable(done)  # a grown group's newcomers have no part: it redoes the round
                kept = self.receive(source) if refill is None else self.kept
            except Exception as e:  # noqa: BLE001 - gloo's refusals, a store's timeout: one more loss
                error = self._lost(e, "regrouping" if error is not None else "taking in a newcomer")
                continue
            break
        assert kept is not None, "a member resumes a round it kept the start of (`_resumable`)"
        lost = [m for m in first.members if m not in self.group.members]
        joined = [m for m in self.group.members if m not in first.members]
        counters, seconds = kept.counters, time.monotonic() - began
        if joined:
            _say(f"member {self.me}: member{'s' if len(joined) > 1 else ''} {', '.join(map(str, joined))} joined (generation "
                 f"{self.generation}): {len(self.group.members)} processes, {seconds:.2f} s to take in")  # fmt: skip
        if refill is None:
            after = f"{len(self.group.members)} processes from round {counters.rounds + 1}, {seconds:.1f} s after the loss"
        else:
            after = (f"{len(self.group.members)} processes resume round {counters.rounds + 1}, {len(refill[0])} of its batches to train again, "
                     f"{seconds:.1f} s after the loss")  # fmt: skip
        if lost:
            _say(f"member {self.me} goes on without member{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} (rank "
                 f"{', '.join(str(first.rank(m)) for m in lost)} of generation {first.generation}): {after}")  # fmt: skip
        elif error is not None and not joined:  # a connection lost, every member there: the group formed again
            _say(f"member {self.me} goes on with every member of generation {first.generation} (a connection lost: {error.summary[:200]}): {after}")
        since = time.monotonic() - start
        told = [Replacement(first.rank(m), error or _lost_as_it_grew(first, m), counters.rounds + 1, since, counters=counters) for m in lost]
        if refill is None:
            return self.redo(kept, until_epoch, start), told
        assert done is not None and mine is not None
        return self._resume(Resume(done, *refill, mine, starts), until_epoch, start), told

    def _resumable(self, done: Progress | None) -> tuple[tuple[int, ...], int] | None:
        """Where every member of the group (the survivors of a loss) has its part of the same round
        in flight (Rounds.progress) and kept that round's start, what they claim to resume it: the
        round's batches below the last any of them claimed that none trained (the lost members',
        and those held for a later round), then on from there; claims past it that a lost member
        took are taken again in turn. Else None: the round is redone from its kept start."""
        parts: list[tuple[Progress | None, int | None]] = [(None, None)] * len(self.group.members)
        dist.all_gather_object(parts, (done, None if self.kept is None else self.kept.seq))
        return refill(parts)

    def _resume(self, resume: Resume, until_epoch: int, start: float) -> FitCommand:
        """The fit that resumes the round in flight (`_resumable`): from the start this member kept
        (the anchor of an outer step or a share), with its own state since (`resume.state`)."""
        kept = self.kept
        assert kept is not None and kept.seq == resume.progress.seq
        self.worker.rounds.regrouped(self.worker.own_state())  # the last exchange's measure goes, being this member's only
        self.worker.rounds.seq = kept.seq - 1  # the resumed round is `kept.seq` again
        # What this worker keeps while it resumes the round, until the round's start keeps it anew:
        # a loss before then redoes this round from its start.
        self.kept, self._redo = None, dataclasses.replace(kept, own=self.worker.own_state())
        return FitCommand(until_epoch, dataclasses.replace(kept.counters), kept.state, None, start, resume=resume)

    # -- the group -------------------------------------------------------------------------------------

    def _lost(self, error: Exception, doing: str) -> WorkerError:
        """A collective or a store call that failed while this member was `doing` something with
        its new group: a loss, said as its worker says a failure."""
        failed = self.worker.failure(error)
        return WorkerError(self.rank, f"lost its peers while {doing} (fleet generation {self.generation}): {failed.summary}", failed.details)

    def _enter_group(self) -> None:
        """Join this generation's process group, as this member's rank of it, and its own store
        (`local`): rank 0 hosts it, its address in the fleet's store."""
        prefixed = PrefixStore(f"generation-{self.generation}/group", self.store)
        form(prefixed, self._timeout, lambda store, timeout: self._join(store, timeout, self.rank, len(self.group.members)))
        self.local, where = None, f"generation-{self.generation}/local"  # the last generation's goes
        if self.rank == 0:
            self.local = TCPStore(self._host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout)
            self.store.set(where, f"{self._host}:{self.local.port}")
        else:
            self.local = self._reach_rank_0(where)
            self.local.set_timeout(self._timeout)

    def _reach_rank_0(self, where: str) -> Store:
        """A client of the generation's store, which its rank 0 hosts: its address (at `where` in
        the fleet's store) waited for FORM_S at most, as the group's forming, and both it and the
        connection no longer than rank 0 lives (`_gone`). Rank 0 lost as the group formed (or gone
        to the next generation, its own forming failed) never writes it, or stops answering as
        this member connects, and a TCPStore client retries a refused connection three times over
        (13-14 s with FORM_S's timeout; a driver that killed rank 0 as it sent its state to a
        newcomer saw every peer wait so, on loopback): this member waiting here holds every peer,
        which waits for it in `_agree`. The client is made on a thread of its own (its constructor
        lets go of the GIL) so that this one asks after rank 0 meanwhile."""
        rank_0, deadline = self.group.members[0], time.monotonic() + FORM_S
        made: list[Store | Exception] = []

        def connect(host: str, port: int) -> None:
            try:
                made.append(TCPStore(host, port, is_master=False, timeout=_FORM))
            except Exception as e:  # noqa: BLE001 - refused, reset, timed out: said in this member's thread
                made.append(e)

        asked = False
        while not made:
            if self._gone(rank_0):
                raise ConnectionError(f"rank 0 of fleet generation {self.generation} (member {rank_0}) is gone: this member never reached the store it hosts")
            if not asked and self.store.check([where]):
                host, _, port = self.store.get(where).decode().rpartition(":")
                threading.Thread(target=connect, args=(host, int(port)), name="parallelwrapper-generation-store", daemon=True).start()
                asked = True
            elif not asked and time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 of fleet generation {self.generation} (member {rank_0}) did not host its store within {FORM_S:g} s")
            time.sleep(_POLL_S)
        if isinstance(made[0], Exception):
            raise made[0]
        return made[0]

    def _rebuilt(self) -> Replaceable:
        """This member's worker rebuilt for the group as it is now, with its own state as it was."""
        worker, own = self._rebuild(self.rank, len(self.group.members)), self.worker.own_state()
        worker.load_own_state(own)
        return worker

    def _latest(self, processes: int) -> Group:
        """The latest generation: the last written, or the first `processes` (generation 0). Its
        members are written before it is made the latest (`_decide`), and a writer that stalled
        in between may set `latest` back a generation: the members written past `latest`'s
        count say which is the last."""
        if not self.store.check(["latest"]):
            return Group(0, tuple(range(processes)))
        generation = int(self.store.get("latest"))
        while self.store.check([f"generation-{generation + 1}/members"]):
            generation += 1
        return self._written(generation)

    def _written(self, generation: int) -> Group:
        """Generation `generation` as its members were written in the store."""
        return Group(generation, tuple(int(m) for m in self.store.get(f"generation-{generation}/members").decode().split(",")))

    def _agree(self, error: WorkerError | None) -> tuple[Group, int, bool]:
        """Come to the generation after this group's with the round this member kept, and return
        it once its members are agreed, with the rank whose kept round every one takes and whether
        it grew (newcomers in it). The first
        member to say it (the store's `add`, as regroup._say) writes it, and every member takes it
        as written, whatever it saw itself:
        - one that grows the group (`error` None, after GroupChanges) says it at once: this group's
          members, then the newcomers; every one kept the same round, and rank 0's is taken;
        - one after a loss, once every member of this group has come or is gone (silent for
          `gone_s`, or still away after the collective timeout): those that came; the newest
          round they kept is taken (replacer.newest).
        A member that saw a loss in the last round's collective while the others went on to grow
        the group comes to the same generation: one rule for both, where two left each waiting
        for the other's words."""
        old, g = self.group, self.group.generation + 1
        store = PrefixStore(f"generation-{g}", self.store)
        kept = self.round
        store.set(f"kept/{self.me}", json.dumps(None if kept is None else [kept[0], dataclasses.asdict(kept[1])]))
        if error is None and store.add("said", 1) == 1:
            store.set("grown", "1")
            newcomers = tuple(int(self.store.get(f"joiner/{k}")) for k in range(self._admitted, self._joining))
            self._decide(Group(g, old.members + newcomers), self._joining)
        deadline = time.monotonic() + self._timeout.total_seconds()
        while not store.check(["members"]):
            away = [m for m in old.members if not store.check([f"kept/{m}"])]
            if all(self._gone(m) for m in away) or time.monotonic() > deadline:
                if store.add("said", 1) == 1:  # the first to see the count closed writes the list
                    self._decide(Group(g, tuple(m for m in old.members if m not in away)), self._admitted)
                break
            time.sleep(_POLL_S)
        group = self._written(g)
        self._admitted = int(store.get("admitted"))
        if self.me not in group.members:
            raise WorkerError(
                old.rank(self.me),
                f"the fleet went on without member {self.me} (generation {g} formed of members {list(group.members)}): it was "
                f"silent for {self._gone_s:g} s or more while its peers regrouped (stopped, or its link cut); start it again",
            )
        if store.check(["grown"]):
            return group, 0, True
        said = {r: json.loads(store.get(f"kept/{m}")) for r, m in enumerate(group.members)}
        rounds = {r: None if v is None else (int(v[0]), Counters(**v[1])) for r, v in said.items()}
        return group, newest(rounds, [] if error is None else [error])[0], False

    def _decide(self, group: Group, admitted: int) -> None:
        """Write `group`, the next generation, with the count of newcomers taken in by then, and
        make it the latest: a newcomer waits to read the generation that lists it, then that count."""
        self.store.set(f"generation-{group.generation}/admitted", str(admitted))
        self.store.set(f"generation-{group.generation}/members", ",".join(map(str, group.members)))
        self.store.set("latest", str(group.generation))


def refill(parts: list[tuple[Progress | None, int | None]]) -> tuple[tuple[int, ...], int] | None:
    """`Survivor._resumable` from every member's (part of the round in flight, the round whose
    start it kept): (holes, then), or None unless each has its part of one round and kept its start."""
    progress = [done for done, kept in parts if done is not None and kept == done.seq]
    if len(progress) < len(parts) or len({(p.seq, p.end) for p in progress}) > 1:
        return None
    trained = {i for p in progress for i in p.trained}
    then = max(p.claimed for p in progress)
    return tuple(i for i in range(then) if i not in trained), then


def agreed_joining(local: Store, fleet: Store, tag: int) -> int:
    """The count of processes waiting to join the fleet (its store's `joining`) that every member
    of a group takes at round `tag`'s start: each proposes the count as it reads it, and the first
    proposal stands (a compare-and-set in the group's store, `local`). No member waits on another:
    where the first to start a round read the count and every other waited for it to write it,
    the first lost in between held its peers until the heartbeat's judge shut the group's
    connections (peer_timeout later)."""
    seen = fleet.get("joining").decode() if fleet.check(["joining"]) else "0"
    return int(local.compare_set(f"round-{tag}/joining", "", seen))


def _lost_as_it_grew(group: Group, member: int) -> WorkerError:
    """What a member that was growing `group` is told of `member`, lost meanwhile: it saw no
    failure of its own, a peer did (and said the next generation without it)."""
    return WorkerError(group.rank(member), f"lost as generation {group.generation} took in a newcomer (a peer saw the loss)")


def _say(line: str) -> None:
    """One line of the fleet's news, on stderr: who left and who joined."""
    print(f"parallelwrapper: {line}", file=sys.stderr, flush=True)


__all__ = ["Group", "Join", "Survivor", "agreed_joining", "refill"]

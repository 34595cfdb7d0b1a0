"""A fleet's process: one of processes launched apart that form their group in a shared store, go on without a lost one and take in one that comes.

`.fleet("etcd://m1:2379,m2:2379,m3:2379/NAME", processes=N).on_worker_failure("replace")`: each
machine runs its own torchrun (or python), and no process of the job hosts the store (an etcd
cluster, or one TCPStore for a small job: `connect`), so no machine is one the others cannot lose
(docs/guides/many-machines.md). torchrun's agent restarts every worker of its
job when the job's membership changes; a fleet's jobs are one per machine, so a machine lost is
no change to the others' agents, and the fleet's group is the library's own. This host:
- enters the fleet by its member's part that outlives a loss (the replacement feature's survivor,
  which the wrapper hands it): generation 0 of the first N, or a later one that takes it in;
- beats in the store and hears its peers' beats (heartbeat.py), which says who is silent, and
  answers on a socket of its own (`Lifeline`), which a dead process's peers find refused at once;
- ends its collective at once when a peer is gone without closing anything (stopped, its link
  cut): the heartbeat's judge shuts this member's connections of its group (connections.py), and
  so every member's collective ends and the survivors regroup, where gloo alone would wait out its
  timeout;
- claims its batches first-come (feed/claims.py), so that a round's are anyone's, from the store
  its generation's rank 0 hosts (the survivor's `local`: replacement/fleet.py says why not etcd);
- answers a peer lost in a collective, and a process that comes to join, by the survivor's new
  group (`regroup`, `grow`), for which it rebuilds its worker (`_build`), and redoes the round.
A newcomer's first fit() joins the fit in progress with the state of a peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import re
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from .. import feed
from ..config import Config, fleet_address
from ..env import Placement, claim_device, collective_timeout
from ..errors import GroupChanges, WorkerError
from ..feature import Feature, Plain
from ..feed.claims import Counter, Refill, StoreCounter, claimed
from ..feed.data import Batches
from ..hooks import RoundObserver
from ..job import Job
from ..messages import FitCommand
from ..types import Replacement, Reporter, TrainingState
from .connections import Connections, endpoints
from .heartbeat import Heartbeat
from .runtime import SignalHooks, Worker, stop_on_signals
from .torchrun import PEER_GONE, from_rank_0

# gloo's words for a peer gone (torchrun.py's), or refused, or silent past the collective's
# timeout; and a TCPStore client's, for the store of a generation whose rank 0 is gone.
_PEER_GONE = re.compile(f"{PEER_GONE.pattern}|Timed out waiting|Connection refused|Connection was likely closed")
_ENTER_S = 600.0  # how long a process waits to enter the fleet: for every machine's first processes, or to be taken in
_ASK_S = 0.5  # how long one ask of an etcd member whether it leads may take: on a LAN, milliseconds
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # to the members, never through an HTTP proxy of the environment

# How a member joins a generation's process group: over this store, with this timeout, as this rank of this size.
Join = Callable[[Store, datetime.timedelta, int, int], None]


class Survival(RoundObserver, Protocol):
    """A fleet member's part that outlives a loss (replacement/fleet.py's Survivor), as this host
    asks it: the round loop tells it where each round starts (it keeps that state)."""

    me: int  # its member id, for life
    local: Store | None  # its generation's own store, which its rank 0 hosts: the claims go there

    @property
    def rank(self) -> int:
        """This member's rank in the group as it is now."""
        ...

    @property
    def generation(self) -> int:
        """The group's generation as it is now: 0, then one more at each change."""
        ...

    @property
    def newcomer(self) -> bool:
        """Whether it joined a running fleet and its first fit has yet to take the fleet's state."""
        ...

    def enter(self, processes: int, gone: Callable[[int], bool], watch: Callable[[tuple[int, ...]], None], wait_s: float, host: str) -> tuple[int, int]:
        """(rank, size) of the group it enters, which `processes` form first; `host`: the address its peers reach it at."""
        ...

    def attach(self, worker: Worker) -> None:
        """Its worker, built for its group."""

    def leave(self) -> None:
        """It leaves the fleet."""

    def started(self) -> None:
        """The fit has loaded its state."""

    def welcome(self, until_epoch: int, start: float) -> FitCommand:
        """A newcomer's first fit: the one that redoes the fleet's round with it."""
        ...

    def grow(self, until_epoch: int, start: float) -> tuple[FitCommand, list[Replacement]]:
        """After GroupChanges: the fit that redoes the round with the newcomers (after a loss
        as they came, without the lost: what the caller is told of them)."""
        ...

    def regroup(self, error: WorkerError, until_epoch: int, start: float) -> tuple[FitCommand, list[Replacement]]:
        """After `error`: the fit that redoes the lost round in the group of the survivors, and
        what the caller is told of each member lost."""
        ...


# What makes a member's Survival (replacement.survivor(config)): from the fleet's store, the seconds
# after which a silent peer is gone, the collectives' timeout, how it joins a group and how it
# rebuilds its worker for a group's (rank, size).
Surviving = Callable[[Store, float, datetime.timedelta, Join, Callable[[int, int], Worker]], Survival]


class Lifeline:
    """A socket every member listens on, its address in the fleet's store, so that a peer can
    tell a dead process at once: connecting to it is refused (its machine still up), where a
    silent heartbeat takes peer_timeout to say so. A daemon thread accepts, answers a byte and
    closes: a stopped process's kernel still accepts, but nothing answers."""

    _ASKED_S = 0.1  # how long one peer's answer stands before it is asked again
    _WAIT_S = 0.5  # how long a connection may take: past it, the heartbeat judges

    def __init__(self, store: Store, me: int, store_host: str, store_port: int) -> None:
        self._store, self._asked, self._addresses = store, dict[int, tuple[float, bool | None]](), dict[int, tuple[str, int]]()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # the address by which the store, and so the fleet, reaches this machine
            probe.connect((socket.gethostbyname(store_host), store_port))
            here = probe.getsockname()[0]
        self.host = here
        self._server = socket.create_server((here, 0))
        threading.Thread(target=self._accept, name="parallelwrapper-lifeline", daemon=True).start()
        store.set(f"lifeline/{me}", f"{here}:{self._server.getsockname()[1]}")

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:  # closed
                return
            with connection, contextlib.suppress(OSError):  # the asker gone already
                connection.sendall(b"!")

    def ask(self, member: int) -> bool | None:
        """Whether `member`'s process answers (True), refuses a connection (False: it is dead), or
        nothing answers in _WAIT_S (None: it is stopped, its machine lost or cut off, or it has
        yet to listen); as asked at most _ASKED_S ago."""
        now = time.monotonic()
        asked = self._asked.get(member)
        if asked is not None and now - asked[0] < self._ASKED_S:
            return asked[1]
        answer: bool | None = None
        if (address := self._address(member)) is not None:
            try:
                with socket.create_connection(address, timeout=self._WAIT_S) as connection:
                    answer = connection.recv(1) == b"!" or None
            except ConnectionRefusedError:
                answer = False
            except OSError:  # a timeout, an unreachable network
                answer = None
        self._asked[member] = (time.monotonic(), answer)
        return answer

    def learn(self, members: tuple[int, ...]) -> None:
        """Read the addresses of `members` not known yet, while the store answers (a group just
        formed): asked later, when the store may be the thing lost, they need no store."""
        for member in members:
            self._address(member)

    def _address(self, member: int) -> tuple[str, int] | None:
        """Where `member` listens: from the store once, then as kept; None before it listens."""
        if member not in self._addresses and self._store.check([f"lifeline/{member}"]):
            host, _, port = self._store.get(f"lifeline/{member}").decode().rpartition(":")
            self._addresses[member] = (host, int(port))
        return self._addresses.get(member)

    def close(self) -> None:
        self._server.close()


@dataclass(frozen=True)
class Connected:
    """The fleet's store as this process reaches it: the fleet's keys, a way to make another
    client (a thread's own), and where it is (for the messages, and the address this machine
    reaches it by)."""

    store: Store
    connect: Callable[[], Store]
    where: str
    first: tuple[str, int]
    steady: Callable[[float], None] = lambda wait_s: None  # waits, at most so long, until the store takes writes at once (etcd's `_steady`)


def connect(address: str, answer_s: float, timeout: datetime.timedelta) -> Connected:
    """The store at `address` (config.fleet_address), given `answer_s` to answer; its clients'
    calls wait up to `timeout`."""
    scheme, hosts, name = fleet_address(address)
    where = ",".join(f"{h}:{p}" for h, p in hosts)
    if scheme == "tcp":
        (host, port), = hosts

        def client() -> Store:
            return PrefixStore(name, TCPStore(host, port, is_master=False, timeout=timeout))
    else:
        try:
            import etcd  # python-etcd: the v2 API, as torchrun's etcd rendezvous
        except ImportError:
            raise RuntimeError("a fleet's store on etcd needs python-etcd: pip install python-etcd") from None
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        def etcd_client() -> etcd.Client:
            # Any member answers; a member lost, the client goes on with the others.
            return etcd.Client(host=hosts, allow_reconnect=True, read_timeout=max(1, int(answer_s)))

        def client() -> Store:
            return EtcdStore(etcd_client(), f"/parallelwrapper/{name}", timeout)

    try:
        probe = (TCPStore(hosts[0][0], hosts[0][1], is_master=False, timeout=datetime.timedelta(seconds=answer_s)) if scheme == "tcp"
                 else client().check(["enrolled"]))  # fmt: skip
        del probe
        store = client()
    except Exception:  # noqa: BLE001 - a refused connection, a timeout, etcd's errors: the same advice
        raise RuntimeError(
            f"the fleet's store at {where} did not answer in {answer_s:g} s (peer_timeout): start it first, or "
            "fix .fleet(store) (docs/guides/many-machines.md)"
        ) from None
    if scheme == "tcp":
        return Connected(store, client, where, hosts[0])
    return Connected(store, client, where, hosts[0], lambda wait_s: _steady(hosts, wait_s, store))


def _steady(hosts: tuple[tuple[str, int], ...], wait_s: float, store: Any) -> None:
    """Wait, `wait_s` at most, until a member of the etcd cluster at `hosts` says it leads. A write
    that a member forwards to a leader lost a moment ago waits out the client's read timeout before
    it goes to another member (3.4-3.6 s of a soak's regroups at peer_timeout 3, where its other
    regroups took 0.5-0.9 s), while a new election takes about its election timeout: written once
    a leader answers, the survivors' first word goes at once. Each member is asked directly, each
    ask bounded (_ASK_S): through python-etcd, whose one timeout covers the connect as well and
    whose HTTP tries a connect 4 times, the ask waited 7.0 s at a member whose machine was lost.
    The leader found, `store` (an EtcdStore: the survivors' regroup writes through it) asks it
    first from then on: python-etcd asks the member it last asked first, and that one may be the
    member just lost (its first write after a loss waited 7.0 s there)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for host, port in hosts:
            try:
                with _DIRECT.open(f"http://{host}:{port}/v2/stats/self", timeout=_ASK_S) as answer:
                    if json.load(answer).get("state") == "StateLeader":
                        store.client._base_uri = f"http://{host}:{port}"  # python-etcd has no setter
                        return
            except (OSError, ValueError):  # lost, refusing, not answering yet: the next
                pass
        time.sleep(0.05)


class FleetWorker:
    """The host interface (`fit`, `close`, `kill`) for this process as a member of a fleet."""

    def __init__(self, config: Config, job: Job, placement: Placement, feature: Feature | None, surviving: Surviving) -> None:
        """`feature`: the config's (features.of; None: Plain); `surviving`: what makes this
        member's part that outlives a loss (config.refuse holds a fleet to on_worker_failure("replace"))."""
        env = placement.torchrun
        assert env is not None and config.fleet is not None, "FleetWorker outside a fleet"
        # What the process holds now (torch's modules, the job) lives as long as it does: out of the
        # collector's sight, the full collection that frees a lost group's connections (`fit`) scans
        # only what came since, 20 µs where it took 0.12 s on each regroup and take-in (a 1024-wide
        # MLP's process: 290,000 objects), on the survivors' critical path.
        gc.freeze()
        self._config, self._job, self._feature, self._placement, self._local = config, job, feature or Plain(), placement, env.local_rank
        claim_device(placement, env.local_rank, config.deterministic)
        timeout = collective_timeout(config)
        connected = connect(config.fleet, config.peer_timeout, timeout)
        self._store, self._steady = connected.store, connected.steady
        self._hooks = SignalHooks()
        self._connections, self._members = Connections(endpoints(fleet_address(config.fleet)[1])), tuple[int, ...]()
        self._survival = surviving(self._store, config.peer_timeout, timeout, self._join, self._build)
        self.me = self._survival.me
        self._heartbeat = Heartbeat(connected.connect, connected.where, "heartbeat", self.me, 0, config.peer_timeout, on_lost=self._silent)
        self._lifeline = Lifeline(self._store, self.me, *connected.first)
        try:
            rank, size = self._survival.enter(config.fleet_processes, self._gone, self._watch, _ENTER_S, self._lifeline.host)
        except BaseException:  # FleetEnded, a wait run out: a script that goes on has no heartbeat of this member beating on
            self._heartbeat.close()
            self._lifeline.close()
            raise
        self._connections.taken()
        self._survival.attach(self._build(rank, size))
        self._hooks.observer = self._survival
        self._started = False

    def _gone(self, member: int) -> bool:
        """Whether peer `member` is gone: its process refuses a connection (it died, its machine
        still up); or, where nothing answers (a machine lost or cut off), its heartbeat has not
        moved for peer_timeout. A process that answers is alive, whatever its heartbeat: a store
        that fails over to another member (the lost machine held the one its clients ask) holds
        every count still, and the lifeline, which needs no store, tells the lost from the live."""
        answer = self._lifeline.ask(member)
        return answer is False or (answer is None and self._heartbeat.silent(member) >= self._config.peer_timeout)

    def _watch(self, members: tuple[int, ...]) -> None:
        """The group's members as they are now: the heartbeat watches them."""
        self._members = members
        self._heartbeat.watch(members)
        self._lifeline.learn(members)

    def _silent(self, members: list[int], why: str) -> None:
        """The heartbeat's judge, from its thread: peers silent for peer_timeout (`why`). Those of
        the group that are gone (`_gone`) closed nothing, and the collective waiting on them would
        wait out its timeout: this member shuts its connections of the group, so that its
        collective and every peer's end now, and the survivors regroup without them."""
        taken, group, generation = self._connections.taken_count, self._members, self._survival.generation
        gone = [m for m in members if m in group and self._gone(m)]  # the lifeline's answer may take _WAIT_S: the group may change meanwhile
        if gone and (shut := self._connections.shut(taken)):
            print(f"parallelwrapper: member {self.me}: member{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} gone ({why} for "
                  f"{self._config.peer_timeout:g} s, and nothing answers: stopped, its link cut, or ended): {shut} connection(s) of "
                  f"generation {generation} shut, so that the group regroups now", file=sys.stderr, flush=True)  # fmt: skip

    def _join(self, store: Store, timeout: datetime.timedelta, rank: int, size: int) -> None:
        self._connections.mark()
        dist.init_process_group(self._placement.backend, store=store, rank=rank, world_size=size, timeout=timeout)

    def _build(self, rank: int, size: int) -> Worker:
        """This member's worker as rank `rank` of a group of `size`, from now on."""
        env = self._placement.torchrun
        assert env is not None
        placement = dataclasses.replace(self._placement, world_size=size, torchrun=dataclasses.replace(env, rank=rank, world_size=size))
        self._worker = Worker(self._job, self._config, placement, rank, self._local, hooks=self._hooks, feature=self._feature)
        return self._worker

    def fit(self, command: FitCommand, data: Batches, on_report: Reporter) -> TrainingState:
        """Train this member's claims of `data`; return the final state, the same on every member."""
        survival, until_epoch, start = self._survival, command.until_epoch, command.start
        if survival.newcomer:
            command = dataclasses.replace(survival.welcome(until_epoch, start), order=command.order)
            self._connections.taken()  # a loss as it was taken in formed another group
        elif not self._started:
            command = dataclasses.replace(command, state=from_rank_0(command.state))
        self._started = True
        with stop_on_signals(self._hooks, (signal.SIGINT, signal.SIGTERM), on_report) as report:
            while True:
                worker, counters = self._worker, command.counters
                claims: Counter | None = None
                if claimed(self._config, self._feature.alone):  # from where the fit (or the round it redoes or resumes) starts, in this group
                    assert survival.local is not None, "a fit outside a group"
                    claims = StoreCounter(survival.local, f"claims/{counters.epoch}-{counters.position}")
                    if command.resume is not None:  # the batches of the round that no survivor trained first
                        claims = Refill(claims, command.resume.holes, command.resume.then)
                source = feed.source(data, survival.rank, dist.get_world_size(), counters, until_epoch, claims, command.order)
                lost: WorkerError | None = None
                try:
                    worker.start(command)
                    survival.started()
                    del command  # loaded: the copy of the state goes now
                    worker.train(until_epoch, source, report)
                    break
                except GroupChanges:
                    pass
                except WorkerError as e:
                    if not _PEER_GONE.search(e.summary):
                        raise
                    lost = WorkerError(e.rank, e.summary, e.details, e.where, e.at, e.stage)  # the same, without its frames
                # The frames of the collective that failed, held by its error's traceback, hold the
                # old group's connections open: a peer blocked on this member, not on the lost one,
                # would wait for the collective's timeout instead of coming to the regroup. So they
                # go before it: the group's destruction then closes the connections at once.
                del worker, source
                gc.collect()
                # This host's worker is rebuilt for the new group (_build).
                if lost is not None:
                    # And its collectives still queued after the one that failed (an average's
                    # buckets) wait on peers that have left: the group's destruction waited for them,
                    # each member on another, until a judge shut the group (peer_timeout later).
                    # Shut now, they fail at once, here and at every peer still waiting on this one.
                    self._connections.shut(self._connections.taken_count)
                    self._steady(self._config.peer_timeout)  # the store's leader may have gone with the lost machine
                command, told = survival.grow(until_epoch, start) if lost is None else survival.regroup(lost, until_epoch, start)
                self._connections.taken()
                for replacement in told:
                    report(replacement)
        return self._worker.replica.whole_state()

    def close(self) -> None:
        """Leave the fleet: the peers stop watching this member, and the group goes."""
        self._survival.leave()
        self._heartbeat.close()
        self._lifeline.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    kill = close


__all__ = ["FleetWorker", "Join", "Surviving", "connect"]

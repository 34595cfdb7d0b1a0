"""A round's exchange landed at once: every replica ends the round holding the average.

The header and the payload go out after the round's local work (SHARED_GRADIENTS: the average is of
the gradients, on which the engine then steps).

Pre-scaling: each worker sends w_i / ref · x_i, where ref is the last round's Σw, which every
worker knows. When this round's Σw is the same (every round but an epoch's last), the sum is the
average: one collective, one pass over memory. Otherwise one more pass scales it by ref / Σw. The
first round of a fit() sends the header alone (ref is unknown) and builds the buffers; so does a
round after which the layouts disagreed (some optimizer created state the buffers lack). With a
coded payload the buffers are built before the first round when the state they average is all
there (every worker's is the fit's starting state): the first round's deltas go encoded too.

With `.average_updaters(every=m)` (DES-LOC) the optimizer's state has buffers of its own (`moments`),
sent only in the rounds the engine marks (every m-th, and where replicas must be equal) or whose
totals say so (an epoch's end, a stop, a skipped worker). They go once the parameters' sums are
in, scaled by w_i / Σw (known by then), and land at the optimizer's next step, as `later` does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..averaging import Errors, FlatAverager, Shards, Starts, all_reduce_values
from ..config import Config
from ..threshold import Residual
from ..types import EncodingStats
from .clock import Clock
from .encoded import EncodedGradients
from .header import (
    HEADER_LEN,
    RoundTotals,
    Work,
    check_diverged,
    read_header,
    round_header,
)
from .state import (
    agree_on_optimizer_layout,
    averaged_tensors,
    exact_tensors,
    gradient_tensors,
    holds_state,
    later_tensors,
    optimizer_state_tensors,
    signature_hash,
    state_layout,
    trained_parameters,
)
from .trainer import Trainer


def average_anew(
    trainer: Trainer, config: Config, device: torch.device, group: dist.ProcessGroup | None, share: float, agree: bool, shards: Shards | None = None, redoes: bool = False
) -> FlatAverager:
    """Average all of the state at once, in full precision, into new buffers (returned: the
    tensors live in them until `release()`); with `agree`, every worker first takes the union of
    the optimizers' layouts."""
    payload = anew_buffers(trainer, config, device, group, agree, shards, redoes)
    payload.average(share, group)
    return payload


def anew_buffers(
    trainer: Trainer, config: Config, device: torch.device, group: dist.ProcessGroup | None, agree: bool, shards: Shards | None = None, redoes: bool = False
) -> FlatAverager:
    """average_anew's buffers, before their average: with `agree`, after every worker took the
    union of the optimizers' layouts."""
    if agree and config.average_updaters:  # else only the still groups changed
        agree_on_optimizer_layout(trainer.optimizer, group)
    return state_buffers(trainer, config, device, shards, redoes)


def state_buffers(trainer: Trainer, config: Config, device: torch.device, shards: Shards | None = None, redoes: bool = False) -> FlatAverager:
    """New buffers for the state an averaging round averages (the tensors live in them until
    `release()`), in the payload's wire format; the optimizer's state lands later where it can
    (state.later_tensors): at the optimizer's next step, or whatever reads it first. `redoes`: a
    lost round is redone from a copy of the whole state kept at its start (feature.Feature.redoes).
    A fleet's survivors resume a lost round from their own state as it left them: the sums go
    beside it (FlatAverager's `intact`)."""
    with_state = config.average_updaters and config.average_updaters_every == 1  # else in moment_buffers
    tensors = averaged_tensors(trainer.model, trainer.optimizer, with_state)
    later = later_tensors(trainer.optimizer, with_state, redoes)
    exact = exact_tensors(trainer.optimizer) if with_state else []
    return FlatAverager(tensors, device, HEADER_LEN, config.payload_dtype, shards, later, exact, intact=config.fleet is not None)


def moment_buffers(trainer: Trainer, config: Config, device: torch.device) -> FlatAverager | None:
    """With `.average_updaters(every=m)`, m > 1: buffers of the optimizer's state alone, sent in
    the rounds it travels (None: the optimizer holds no tensors)."""
    tensors = optimizer_state_tensors(trainer.optimizer)
    return FlatAverager(tensors, device, intact=config.fleet is not None) if config.average_updaters_every > 1 and config.average_updaters and tensors else None


Group = tuple[dist.ProcessGroup | None, int]  # a process group (None: the default) and its size


@dataclass(frozen=True)
class Sent:
    """A round sent by SyncExchange.launch."""

    averaging: bool  # the state, not the gradients
    layout: int | None  # as declared in the header
    weight: float
    reference: float  # what the payload was pre-scaled by (0: nothing sent yet)
    totals: RoundTotals | None  # when the header went alone: its sums
    moments: bool = True  # with average_updaters(every=m): the optimizer's state travels whatever the totals say
    coded_at: float = 0.0  # when the header went alone, the payload after it, coded in buffers built before the round: when it went


class SyncExchange:
    """One worker's flat buffers of the state (or gradients) and their synchronous averaging."""

    def __init__(self, trainer: Trainer, config: Config, device: torch.device, state: Group, gradients: Group, shards: Shards | None, clock: Clock, redoes: bool = False) -> None:
        self.trainer, self.config, self.device, self.clock, self._redoes = trainer, config, device, clock, redoes
        self._groups = {True: state, False: gradients}  # by `averaging`: under a hierarchy, across nodes or every rank
        self._shards = shards  # with a hierarchy: each rank of a node sends its part across nodes
        self._payload: FlatAverager | EncodedGradients | None = None
        self.residual: Residual | None = None  # with gradient encoding: this worker's, kept from fit to fit
        self._errors: Errors | None = None  # a coded payload's error fed back, kept from buffers to buffers, fit to fit
        self._layout: int | None = None  # the state layout the payload was built for
        self._gradients = False  # the payload holds gradients (SHARED_GRADIENTS, a warm-up)
        self._reference = 0.0  # Σw of the last round that trained, the same on every worker
        self._early = False  # the payload was built before the round it has not sent yet (coded from the start)
        self._moments: FlatAverager | None = None  # average_updaters(every=m): the optimizer's state, apart
        self._moments_sent = False  # on their way, to land at settle()
        self._moments_own = False  # some worker stepped since they last travelled: replicas' states differ
        self._share = 0.0  # this worker's w / Σw in the last round that trained
        self._anew = False  # the next averaging builds its buffers by averaging anew (another rung: the workers' optimizer states may differ)
        self.intact = True  # after a failed round: its sums reached none of the trainer's tensors (FlatAverager.untouched)
        self.starts: Starts | None = None  # after a failed round, intact and coded: what its change was taken from
        self._resumed_from: Starts | None = None  # a resumed round's (`resume`), for its buffers
        # The optimizer's averaged state may land after the round (FlatAverager's `later`): before
        # its next step reads it, at the latest.
        trainer.optimizer.register_step_pre_hook(lambda *_: self._settle_for_step())

    def _settle_for_step(self) -> None:
        """settle() before the optimizer's step reads its state: the seconds it waits are the
        last round's exchange's, though they pass inside local work (on a slow link, most of it)."""
        start = time.perf_counter()
        self.settle()
        self.clock.in_step += time.perf_counter() - start

    def settle(self) -> None:
        """Land what of the last round's average is still on its way (the optimizer's state)."""
        if isinstance(self._payload, FlatAverager):
            self._payload.settle()
        if self._moments_sent:
            assert self._moments is not None
            self._moments.wait()
            self._moments.apply(1.0)  # sent scaled by w_i / Σw: the sum is the average
            self._moments_sent = False

    def reset(self) -> None:
        """The trainer's tensors were replaced (a fit() loads new state): build buffers afresh."""
        self._payload, self._gradients, self._reference, self._early = None, False, 0.0, False
        self._moments, self._moments_sent, self._moments_own = None, False, False

    def use(self, config: Config) -> None:
        """Another payload or optimizer-state period (the autopilot's), from the next averaging
        round on, into buffers for `config`. Where what it averages may differ between workers
        (the optimizer's state, after rounds that did not send it), that round averages every
        worker's whole state anew in full precision; else, as at a fit's start, a coded payload
        codes that round already, from the state every worker holds after the last average."""
        old = self.config
        self.release()
        equal = not config.average_updaters or (old.average_updaters and old.average_updaters_every == 1)
        self.config, self._reference, self._anew = config, 0.0, not equal

    def release(self, settle: bool = True) -> None:
        """Between fits, the model's tensors own their storage; after a failure (not `settle`),
        what of the last average is still on its way is dropped."""
        if not settle:  # failing: what a fleet's survivors resume the round from (Rounds.progress)
            payload = self._payload
            self.intact = not isinstance(payload, FlatAverager) or payload.untouched()
            self.starts = payload.starts() if isinstance(payload, FlatAverager) else None
        if isinstance(self._payload, FlatAverager):
            self._errors = self._payload.errors(failed=not settle) or self._errors  # what this worker has yet to send goes on
            self._payload.release(settle)
        elif self._payload is not None:
            self._payload.release()
        if self._moments is not None:
            if settle:
                self.settle()
            self._moments.release()
        self._payload, self._gradients, self._early = None, False, False
        self._moments, self._moments_sent = None, False

    def prepare(self, averaging: bool) -> None:
        """Before a round's local work: a gradient round allocates zero gradients in its buffers
        before the first backward; the first averaging round after a warm-up lets them go."""
        if averaging and self._gradients:
            self.release()
        starts, self._resumed_from = self._resumed_from, None  # the round resumed is this one
        if averaging and self._payload is None and self._codes_from_start():
            # Every worker starts a fit() (and leaves a warm-up) from the same state: the first
            # round's deltas are taken from it, and go encoded too; a resumed round's, from its start.
            payload = state_buffers(self.trainer, self.config, self.device, self._shards, self._redoes)
            if payload.start_coding(self._groups[True][0], self._errors, starts):
                self._payload, self._layout, self._early = payload, self.state_layout(True), True
            else:  # the starts do not fit these buffers: the round is averaged anew, in full precision
                payload.release()
                self._anew = True
        if not averaging:
            self._gradient_payload()
            self.trainer.optimizer.zero_grad(set_to_none=False)

    def resume(self, starts: Starts | None) -> None:
        """The next averaging round is one that a fleet's survivors resume, each from its own state
        since the round's start (Rounds.resume): a coded payload takes its change from `starts`
        (its coders' when the round failed: the round's start, the same on every survivor). Where
        none came (the round was not coded) or they do not fit, it is averaged anew in full precision."""
        self._resumed_from = starts
        if starts is None and self.config.payload_dtype != "float32":
            self._anew = True

    def _codes_from_start(self) -> bool:
        """Whether a fit's first averaging round can go encoded: the payload is coded, its rounds
        land here (with overlap they stream), and the state it averages exists already. An
        optimizer creates its state at a parameter's first step, so a first fit() that averages
        it builds its buffers after the first round, in full precision, as does plain SGD."""
        trainer, config = self.trainer, self.config
        if config.payload_dtype == "float32" or config.overlap_averaging or self._anew:
            return False
        return not config.average_updaters or holds_state(trainer.optimizer, trained_parameters(trainer.model, trainer.optimizer))

    def errors(self) -> Errors | None:
        """A coded payload's error fed back: what this worker has yet to send (for a checkpoint)."""
        return (self._payload.errors() if isinstance(self._payload, FlatAverager) else None) or self._errors

    def keep_errors(self, errors: Errors) -> None:
        """Feed `errors` (a checkpoint's) back into the next coded buffers this worker builds."""
        self._errors = errors

    def state_layout(self, averaging: bool) -> int:
        return state_layout(self.trainer.optimizer, self.config.average_updaters) if averaging else 0

    def launch(self, work: Work, averaging: bool, stop: bool, moments: bool = True, meet: bool = False) -> Sent:
        """Send the round's header and payload. Once the buffers exist and a round has trained,
        the header rides in the payload's trailer, pre-scaled by w / reference; else the header
        goes alone (and is waited for), then the payload when anyone trained. `moments`: with
        average_updaters(every=m), the optimizer's state travels in this round (land() sends it).
        `meet`: every worker arrives first (a one-number all-reduce), so that the exchange's
        seconds after it are the link's and the codec's, not the wait for a slower worker, which
        no k or payload shortens (the clock's `waited`: a policy's measure)."""
        if meet:
            start = time.perf_counter()
            all_reduce_values([0.0], self.device, self._groups[True][0])
            self.clock.waited = time.perf_counter() - start
        self.settle()  # the optimizer's state, where no step has read it since the last round
        payload = self._payload if averaging else self._gradient_payload()
        current, built = self.state_layout(averaging), None if payload is None else self._layout
        if averaging and (payload is None or self._early):  # the header goes alone, and says whether
            # this worker built its buffers before the round: every worker must have, or none
            current, built = signature_hash((current, self._early)), None if built is None else signature_hash((built, self._early))
        header, layout = round_header(work, current, built, stop)
        group, size = self._groups[averaging]
        if payload is not None and self._reference > 0 and not self._early:
            payload.send(work.weight / self._reference, header, group)
            return Sent(averaging, layout, work.weight, self._reference, None, moments)
        totals = read_header(all_reduce_values(header, self.device, group), layout, size)
        early, self._early = self._early, False
        if payload is not None and averaging and not totals.layouts_agree:
            self.release()  # built before the round, where some worker could not: averaged anew in land()
            payload = None
        coded_at = 0.0
        if payload is not None and totals.samples > 0:
            coded_at = time.perf_counter() if early else 0.0
            payload.send(work.weight / totals.samples, group=group)
        return Sent(averaging, layout, work.weight, totals.samples, totals, moments, coded_at)

    def land(self, sent: Sent) -> RoundTotals:
        """Wait for the sums and apply them. A worker that did not train sent zeros; when nobody
        did, every worker drops the sums. The first averaging of a fit() builds the buffers."""
        payload = self._payload
        self.clock.landed(whole=sent.totals is None)  # its header rode in the payload's trailer: no buffers built, no header alone
        if sent.totals is None:
            assert payload is not None
            totals = read_header(payload.wait(), sent.layout, self._groups[sent.averaging][1])
        else:
            totals = sent.totals
            if payload is not None and totals.samples > 0:
                payload.wait()
        if totals.samples == 0:
            check_diverged(totals)
            if payload is not None and sent.totals is None:
                payload.discard()  # every worker sent zeros: nothing to apply
            if sent.averaging and (totals.epoch_done or totals.stop):
                self._send_moments(self._share)  # nobody trained: the last round's weights
            return totals
        if payload is not None:
            payload.apply(sent.reference / totals.samples)
            if isinstance(payload, FlatAverager):
                self.clock.codec = payload.codec_seconds()
            if sent.coded_at:  # the rung's own bytes and codec: a measure of it
                self.clock.alone = time.perf_counter() - sent.coded_at
        if sent.averaging:
            if payload is None or not totals.layouts_agree:
                share, agree = sent.weight / totals.samples, not totals.layouts_agree
                group = self._groups[True][0]
                self._payload = anew_buffers(self.trainer, self.config, self.device, group, agree, self._shards, self._redoes)
                start = time.perf_counter()
                self._payload.average(share, group, self._errors)
                if self.config.payload_dtype == "float32":  # the rung's own bytes: a measure of it
                    self.clock.alone = time.perf_counter() - start
                self._anew = False
                self._layout = self.state_layout(True)  # released after fit()
                self._moments = moment_buffers(self.trainer, self.config, self.device)
            self._moments_own, self._share = True, sent.weight / totals.samples
            if sent.moments or totals.epoch_done or totals.stop or totals.skipped:
                self._send_moments(self._share)
            self.trainer.averaged()
        self._reference = totals.samples
        return totals

    def _send_moments(self, share: float) -> None:
        """With average_updaters(every=m): send the optimizer's state, scaled by this worker's
        share, unless it is the same on every worker already; it lands at settle()."""
        if self._moments is not None and self._moments_own:
            self._moments.send(share, group=self._groups[True][0])
            self._moments_sent, self._moments_own = True, False

    def _gradient_payload(self) -> FlatAverager | EncodedGradients:
        if self._payload is None:
            model, optimizer, encoding = self.trainer.model, self.trainer.optimizer, self.config.gradient_encoding
            if encoding is None:
                self._payload = FlatAverager(gradient_tensors(model, optimizer), self.device, HEADER_LEN)
            else:
                self._payload = EncodedGradients(model, optimizer, self.encoding_residual(), encoding, self.device, HEADER_LEN)
            self._layout, self._gradients = 0, True
        return self._payload

    def encoding_residual(self) -> Residual:
        """With gradient encoding: this worker's residual (zeros at first), τ and step count."""
        assert self.config.gradient_encoding is not None
        if self.residual is None:
            n = sum(p.numel() for p in trained_parameters(self.trainer.model, self.trainer.optimizer))
            self.residual = Residual.zeros(n, self.device, self.config.gradient_encoding)
        return self.residual

    def encoded_round(self) -> EncodingStats | None:
        """With gradient encoding, the last round landed: τ after it, its density and bytes."""
        return self._payload.last if isinstance(self._payload, EncodedGradients) else None


__all__ = ["Sent", "SyncExchange", "average_anew"]

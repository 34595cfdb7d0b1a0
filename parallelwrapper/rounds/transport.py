"""A worker's exchanges, as its rounds' policy sets them: each round landed at once, or a round late.

Every round goes through the synchronous exchange (exchange.py), but for the averaging rounds of an
overlapped setting (`overlap_averaging`, or the autopilot's last resort), which go through the
streamed one (streaming.py). `use` puts a policy's choice in force on them: another payload or
optimizer-state period from the next averaging round on, or overlap. What of them a worker keeps
(an encoding's residual, a codec's error fed back) goes in its own state in a checkpoint."""

from __future__ import annotations

import torch

from ..averaging import Errors, Shards, Starts
from ..config import Config
from ..hooks import RoundObserver
from ..types import InForce, StateDict
from .clock import Clock
from .exchange import Group, Sent, SyncExchange
from .header import RoundTotals, Work
from .policy import Choice, in_force, overlapped
from .streaming import Launched, StreamExchange
from .trainer import Trainer


class Transport:
    """One worker's synchronous exchange and, where averaging rounds are overlapped, its streamed one."""

    def __init__(self, trainer: Trainer, config: Config, device: torch.device, state: Group, gradients: Group, shards: Shards | None, clock: Clock, redoes: bool = False) -> None:
        """`state`: the group an averaging round goes over, and its size; `gradients`: a gradient
        round's (SyncExchange); `redoes`: a lost round is redone from a copy of the whole state kept
        at its start (feature.Feature.redoes)."""
        self.trainer, self.config, self._device, self._state, self._clock, self._redoes = trainer, config, device, state, clock, redoes
        self.sync = SyncExchange(trainer, config, device, state, gradients, shards, clock, redoes)
        self.stream = StreamExchange(trainer, config, device, *state, clock, redoes) if config.overlap_averaging else None

    def overlapped(self, averaging: bool) -> bool:
        """Whether a round (an `averaging` one or not) lands after the next round's local work."""
        return averaging and self.stream is not None

    def reset(self) -> None:
        """The trainer's tensors were replaced (a fit() loads new state): build buffers afresh."""
        self.sync.reset()
        if self.stream is not None:
            self.stream.reset()

    def prepare(self, averaging: bool) -> None:
        """Before a round's local work (SyncExchange.prepare, StreamExchange.prepare)."""
        self.sync.prepare(averaging)
        if self.stream is not None and averaging:
            self.stream.prepare()

    def resume(self, starts: Starts | None) -> None:
        """The next averaging round is resumed after a loss (SyncExchange.resume): never overlapped."""
        self.sync.resume(starts)

    def launch(self, work: Work, averaging: bool, stop: bool, moments: bool, meet: bool) -> Sent | Launched:
        """Send the round after `work` (SyncExchange.launch; overlapped, StreamExchange.launch)."""
        if self.stream is not None and averaging:
            return self.stream.launch(work, stop)
        return self.sync.launch(work, averaging, stop, moments, meet)

    def land(self, launched: Sent | Launched, skipped_since: bool, at_once: bool, observer: RoundObserver | None) -> RoundTotals:
        """Land a launched round (StreamExchange.land's arguments, which a round sent at once
        needs none of); an overlapped one landed late shows `observer` its average (one landed
        at once is followed by a round's start from its average: seen there)."""
        if isinstance(launched, Sent):
            return self.sync.land(launched)
        assert self.stream is not None
        at_average = observer.average_landed if observer is not None and observer.wants_averages and not at_once else None
        return self.stream.land(launched, skipped_since, at_once, at_average)

    def ran(self, k: int) -> InForce:
        """What a round of `k` local steps ran with, for its Score (before the policy changes it)."""
        config = self.config
        every = config.average_updaters_every if config.average_updaters else 0
        return InForce(k, config.payload_dtype, every, self.stream is not None, config.fragments)

    def use(self, choice: Choice, landed: bool = False) -> Config:
        """Send the next averagings as `choice` says: its payload and optimizer-state period (k is
        read at each round's start); overlapped, each landed after the next round's local work.
        Another rung rebuilds the buffers at the next round. `landed`: a round just landed at once,
        its optimizer state too (SyncExchange.use settles it), so every replica holds its average:
        a switch to overlap builds its buffers and codes from it; else (a resumed policy's choice)
        they are built at the fit's first step. Returns the config now in force."""
        config = in_force(self.config, choice)
        if config != self.config:
            self.config = config
            self.sync.use(config)
        if not choice.overlap:
            return config
        # The synchronous exchange lets its buffers go and builds none (no averaging round lands there).
        fixed = overlapped(config, choice)
        if self.stream is not None:
            self.stream.use(fixed)
            return config
        self.sync.use(fixed)
        self.stream = StreamExchange(self.trainer, fixed, self._device, *self._state, self._clock, self._redoes)
        if landed:
            self.stream.start_from_average()
        return config

    def own_state(self) -> StateDict:
        """What of the exchanges a worker keeps, for a checkpoint: with gradient encoding, its
        residual (and τ and the step count, the same on every worker); with a coded payload, the
        error fed back (what this worker has yet to send)."""
        own: StateDict = {}
        if self.config.gradient_encoding is not None:
            own["gradient_encoding"] = self.sync.encoding_residual().state_dict()
        errors = self.sync.errors()
        if errors is not None:
            own["codec_errors"] = errors.state_dict()
        return own

    def load_own_state(self, own: StateDict) -> None:
        """Take `own` (a checkpoint's, `own_state`'s keys among others) as the exchanges' own state."""
        if self.config.gradient_encoding is not None and "gradient_encoding" in own:
            self.sync.encoding_residual().load_state_dict(own["gradient_encoding"])
        if "codec_errors" in own:
            self.sync.keep_errors(Errors.of(own["codec_errors"]))


__all__ = ["Transport"]

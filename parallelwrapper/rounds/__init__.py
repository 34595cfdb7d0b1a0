"""The round protocol, one worker's side of it: rounds, their header, epoch ends, checkpoints, stops and reports.

docs/design.md describes the protocol.

A round, in both modes:
    batches      the epoch's next N·k by index (SHARED_GRADIENTS: N), so every run splits an epoch
                 into the same rounds; a batch past the round's end is held for its round, so the
                 round which trains a worker's last batch already says it finished
    local work   AVERAGING: a step on each of this worker's batches of the round (k each when
                 dealt, first-come otherwise); SHARED_GRADIENTS: one forward/backward
    exchange     AVERAGING: params | buffers | optimizer state; SHARED_GRADIENTS: grads | buffers;
                 one all-reduce per dtype, the header in the first buffer's trailer; launched
                 after the local work and landed at once (exchange.py, with its pre-scaling), or
                 with overlap_averaging after the next round's local work (streaming.py)
    landing      the average applied (and an outer optimizer's step from it), counters, score
                 report, validation, checkpoint (rank 0 writes), stop

One engine runs every round this way (engine.py); each option changes one part of it, so options
compose: a lockstep group (a hierarchy's node) changes the local work (lockstep.py), a warm-up
makes a round a gradient round, an outer optimizer changes what a landing applies, overlap changes
when a round lands.

Its parts: which batches a round trains and their global steps (cut.py), the header every worker
sends with its state and its local work (header.py), what the state is (state.py), the two ways
an exchange lands (exchange.py, streaming.py) and the seconds it measures (clock.py), the score
windows and validation (scores.py), what a round asks of a worker (trainer.py) and of ranks that
step together as one (lockstep.py), what sets each averaging round's k and payload (policy.py: a
fixed setting or the autopilot), and the engine that runs the rounds (engine.py).
"""

from __future__ import annotations

from .engine import Rounds
from .header import HEADER_LEN, RoundTotals, make_header, read_header
from .lockstep import Lockstep
from .trainer import Trainer

__all__ = ["HEADER_LEN", "Lockstep", "RoundTotals", "Rounds", "Trainer", "make_header", "read_header"]

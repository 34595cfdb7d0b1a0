"""The round protocol of DESIGN.md, one worker's side of it: what a round is, what goes in its
header, when the epoch ends, when to checkpoint and stop, and what the score reports say.

A round, in both modes:
    batches      the epoch's next N·k by index (SHARED_GRADIENTS: N), so every run splits an epoch
                 into the same rounds; a batch past the round's end is held for its round, so the
                 round which trains a worker's last batch already says it finished
    local work   AVERAGING: a step on each of this worker's batches of the round (k each when
                 dealt, first-come otherwise); SHARED_GRADIENTS: one forward/backward
    payload      AVERAGING: params | buffers | optimizer state; SHARED_GRADIENTS: grads | buffers;
                 one all-reduce per dtype, the header in the first buffer's trailer
    bookkeeping  counters, score report, checkpoint (rank 0 writes), stop

Pre-scaling: each worker sends w_i / ref · x_i, where ref is the last round's Σw, which every
worker knows. When this round's Σw is the same (every round but an epoch's last), the sum is the
average: one collective, one pass over memory. Otherwise one more pass scales it by ref / Σw. The
first round of a fit() sends the header alone (ref is unknown) and builds the buffers.

With overlap_averaging (AVERAGING only), a round's payload goes out without waiting and lands after
the next round's steps, which are kept on top of the average (driver.py, `Rounds._overlapped_epoch`).

Its parts: which batches a round trains and their global steps (cut.py), the header every
worker sends with its state (header.py), what the state is (state.py), the score windows and
validation (scores.py), what a round asks of a worker (trainer.py), a node's lockstep steps under a
hierarchy (node.py), and the synchronous and overlapped drivers that run the rounds (driver.py).
"""

from __future__ import annotations

from .driver import Rounds
from .trainer import Trainer
from .header import HEADER_LEN, RoundTotals, make_header, read_header
from .node import Node

__all__ = ["HEADER_LEN", "Node", "RoundTotals", "Rounds", "Trainer", "make_header", "read_header"]

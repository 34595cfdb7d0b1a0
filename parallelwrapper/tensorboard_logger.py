"""A listener that writes what fit() reports as TensorBoard scalars (`TensorBoardLogger`).

It writes through `torch.utils.tensorboard` (the `tensorboard` package is an optional extra: `pip
install -e ".[tensorboard]"`). `pw-fit --tensorboard DIR` adds one."""

from __future__ import annotations

import math
from pathlib import Path

from .codec import codec
from .errors import WorkerError
from .listeners import History
from .types import EpochEnd, Score, Validation


class TensorBoardLogger:
    """Scalars under `log_dir`, each at the step of `iteration` (batches trained so far, all
    workers together, over the wrapper's life, so that a second fit() or a resumed run goes on
    along the same axis):

    - `train/round_loss`: each `Score` (the round's mean loss over all workers), with
      `train/lr` (the first parameter group's learning rate) and `train/skipped_workers`;
    - `validation/NAME`: each metric of each validation (`val_loss`, `val_accuracy`, ...);
    - `epoch/loss` and `epoch/seconds`: at each epoch's end, the epoch's mean loss and the
      seconds since its fit() began;
    - `rounds/k`, `rounds/payload_bits`, `rounds/updaters_every`, `rounds/overlap` (1 or 0): what each Score's last round
      ran with (the autopilot's choice, with `.averaging_frequency("auto")`), with
      `rounds/step_s` and `rounds/exchange_s`: the reporting worker's seconds per local step
      and per exchange;
    - `faults/replacements`: the replacements so far, at each replaced worker, and
      `faults/replaced_rank`: its rank.

    Events are flushed every `flush_secs` seconds and at the end of each fit(); `close()` closes
    the file. Like every listener it runs in the main process (rank 0 under torchrun)."""

    def __init__(self, log_dir: str | Path, flush_secs: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                f"TensorBoardLogger({str(log_dir)!r}): the tensorboard package is not installed: "
                "pip install tensorboard (or pip install -e '.[tensorboard]' in a checkout)"
            ) from e
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)
        self._step = 0  # the last iteration heard of: where a replacement is drawn
        self._replacements = 0

    def _at(self, iteration: int) -> int:
        self._step = iteration
        return iteration

    def on_score(self, score: Score) -> None:
        """The round's loss, the learning rate and the workers skipped."""
        step = self._at(score.iteration)
        self.writer.add_scalar("train/round_loss", score.score, step)
        if not math.isnan(score.lr):
            self.writer.add_scalar("train/lr", score.lr, step)
        self.writer.add_scalar("train/skipped_workers", score.skipped, step)
        if score.k:  # what the round ran with (the autopilot's choice), and its measured times
            self.writer.add_scalar("rounds/k", score.k, step)
            self.writer.add_scalar("rounds/payload_bits", 32 if score.payload == "float32" else codec(score.payload).bits, step)
            self.writer.add_scalar("rounds/updaters_every", score.updaters_every, step)
            self.writer.add_scalar("rounds/overlap", int(score.overlap), step)
            for name, value in (("rounds/step_s", score.step_s), ("rounds/exchange_s", score.link_s)):
                if math.isfinite(value):
                    self.writer.add_scalar(name, value, step)

    def on_validation(self, validation: Validation) -> None:
        """Each metric of the validation."""
        step = self._at(validation.iteration)
        for name, value in validation.metrics.items():
            self.writer.add_scalar(f"validation/{name}", value, step)

    def on_epoch_end(self, epoch: EpochEnd) -> None:
        """The epoch's mean loss and the seconds since the fit began."""
        step = self._at(epoch.iteration)
        self.writer.add_scalar("epoch/loss", epoch.score, step)
        self.writer.add_scalar("epoch/seconds", epoch.seconds, step)

    def on_worker_replaced(self, rank: int, reason: WorkerError, lost_round: int) -> None:
        """The count of replacements so far, and the rank replaced."""
        self._replacements += 1
        self.writer.add_scalar("faults/replacements", self._replacements, self._step)
        self.writer.add_scalar("faults/replaced_rank", rank, self._step)

    def on_fit_end(self, history: History) -> None:
        """Write what is pending to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()

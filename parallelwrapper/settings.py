"""The builder's setters, after DL4J's `ParallelWrapper.Builder`: one per option or part of the job.

Each says what its option means; its default is the option's declaration's (config.py), which
ends the setter's docstring when this module loads, so that a default is written once. They only record
what they are given (and refuse what can never be right); `wrapper.Builder.build()` validates the
whole and builds the ParallelWrapper."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

if sys.version_info >= (3, 11):
    from typing import Self
else:  # Python 3.10: typing_extensions comes with torch
    from typing_extensions import Self

from .autopilot import Autopilot
from .config import OPTIONS, Config, GradientEncoding, NanPolicy, Pipeline, TrainingMode, parse_enum
from .feed.data import Batches, compact
from .job import BeforeStep, LossFn, OptimizerFn, OuterSpec, OutputLoss, SchedulerSpec, TrainingStep, ValidationStep
from .payloads import sparse_name
from .registry import changed, end_with_defaults


class Settings:
    """The builder's setters (wrapper.Builder adds `build()`): each sets one option of the
    Config, or one part of the Job, and returns the builder. Their docstrings end with the
    defaults of the options they set, as declared (config.Config).

    `config`, where given, is where the options start: those that differ from their defaults count
    as set, as if by their setters (for options carried as data, e.g. pw-fit's flags)."""

    def __init__(self, model: torch.nn.Module, config: Config | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"ParallelWrapper.builder() takes a torch.nn.Module, got {type(model).__name__}")
        self._model = model
        self._options: dict[str, Any] = {} if config is None else changed(config)
        self._optimizer_cls: type[torch.optim.Optimizer] = torch.optim.SGD
        self._optimizer_kwargs: dict[str, Any] = {"lr": 0.01}
        self._optimizer_fn: OptimizerFn | None = None
        self._before_step: BeforeStep | None = None
        self._lr_scheduler: SchedulerSpec | None = None
        self._outer: OuterSpec | None = None
        self._validation: Batches | None = None
        self._validation_step: ValidationStep | None = None
        self._loss_fn: LossFn | None = torch.nn.functional.cross_entropy
        self._training_step: TrainingStep | None = None
        self._listeners: list[Any] = []

    def optimizer(self, optimizer: type[torch.optim.Optimizer] | OptimizerFn, **kwargs: Any) -> Self:
        """Any `torch.optim` optimizer class and its keyword arguments (default: SGD, lr=0.01), or
        a function `model -> optimizer`, for parameter groups: each worker calls it on its own
        copy of the model. Define the function at module level, so that it reaches the workers."""
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            if "params" in kwargs:
                raise ValueError(
                    "optimizer: params= would hold this process's tensors, not a worker's; for parameter "
                    "groups pass a function instead, e.g. .optimizer(make_optimizer) with "
                    "`def make_optimizer(model): return torch.optim.AdamW([{'params': [...], 'weight_decay': 0.1}, ...])`"
                )
            self._optimizer_cls, self._optimizer_kwargs, self._optimizer_fn = optimizer, dict(kwargs), None
        elif callable(optimizer) and not isinstance(optimizer, (type, torch.optim.Optimizer)) and not kwargs:
            self._optimizer_fn = optimizer
        else:
            got = f"an instance of {type(optimizer).__name__}" if isinstance(optimizer, torch.optim.Optimizer) else repr(optimizer)
            extra = " with keyword arguments (a function takes none: it builds the whole optimizer)" if kwargs else ""
            raise ValueError(
                f"optimizer takes an optimizer class and its kwargs, e.g. .optimizer(torch.optim.SGD, lr=0.01), "
                f"or a function model -> optimizer; got {got}{extra}"
            )
        return self

    def lr_scheduler(self, scheduler: Callable[..., Any], *, interval: str = "epoch", monitor: str | None = None, **kwargs: Any) -> Self:
        """A torch.optim.lr_scheduler class and its keyword arguments, or a function optimizer ->
        scheduler; each worker builds one on its own optimizer, all step in lockstep: `interval`
        "epoch" (default) at each epoch's end, "step" by ceil(batches trained by all workers / N)
        after each averaging. ReduceLROnPlateau steps on `monitor` (default val_loss) at each
        validation, or on the averaged loss without validation data. See README."""
        self._lr_scheduler = SchedulerSpec(scheduler, dict(kwargs), interval, monitor)
        return self

    def outer_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> Self:
        """DiLoCo / SlowMo: after each averaging every worker steps `cls(**kwargs)`, e.g. SGD(lr=0.7,
        momentum=0.9, nesterov=True), on Δ = θ_start − average(θ). Default: none (keep the average)."""
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"outer_optimizer takes a torch.optim optimizer class and its kwargs, e.g. .outer_optimizer(torch.optim.SGD, lr=0.7); got {cls!r}")
        self._outer = OuterSpec(cls, dict(kwargs))
        return self

    def warmup_sync_steps(self, n: int) -> Self:
        """Post-local SGD: the first `n` steps (over the wrapper's life) average gradients every
        step, as SHARED_GRADIENTS does, then the averaging rounds begin."""
        return self._set("warmup_sync_steps", n)

    def payload_dtype(self, dtype: torch.dtype | str, *, density: float | None = None) -> Self:
        """torch.bfloat16, torch.float16, "int8", "int4" or "sparse": each averaging sends the
        floats' change since the last average cast or block-quantized, or (sparse) only the largest
        entries of each 4096 at 2 bits with their indices: 64 (1.56%, 141x fewer bytes than
        float32), or `density`'s share, a fraction in (0, 0.25] ("sparse", density=0.03125: 128,
        72x fewer; the name "sparse:0.03125" says the same). What the encoding loses or leaves
        goes with the next round (error feedback)."""
        name = str(dtype).removeprefix("torch.")
        if density is not None:
            if name != "sparse":
                raise ValueError(f"payload_dtype({name!r}, density={density!r}): a density is the sparse payload's alone; use .payload_dtype('sparse', density={density!r}) or drop it")
            name = sparse_name(density)
        return self._set("payload_dtype", name)

    def gradient_encoding(
        self, threshold: float = 1e-3, *, adaptive: bool = True, min_density: float = 1e-4, max_density: float = 1e-2, residual_clip: float | None = 5.0
    ) -> Self:
        """TrainingMode.SHARED_GRADIENTS with DL4J's threshold encoding (Strom, 2015): each step a
        worker adds lr × its gradient to a residual and sends only the entries past τ
        (`threshold`, at the start), as ±τ with their index (a 2-bit bitmap when denser than 1/16);
        what is not sent stays in the residual. With `adaptive`, τ moves by at most a factor
        0.5^(1/20) a step to keep the share of entries sent in [min_density, max_density]; every 5
        steps the residual is clipped to ±residual_clip·τ (None: never).
        See docs/guides/gradient-encoding.md."""
        return self._set("gradient_encoding", GradientEncoding(threshold, adaptive, min_density, max_density, residual_clip))

    def hierarchy(self, level: str) -> Self:
        """"node": under torchrun with several processes per node, a node's ranks average their
        gradients every step and the nodes average every k steps."""
        return self._set("hierarchy", level)

    def gradient_clipping(self, max_norm: float) -> Self:
        """Clip each step's gradients to a total norm of `max_norm` (clip_grad_norm_), after
        backward and `before_step`, before the optimizer's step; in SHARED_GRADIENTS, the averaged
        gradients."""
        return self._set("gradient_clipping", max_norm)

    def accumulate(self, n: int) -> Self:
        """Gradient accumulation: each batch is one optimizer step, computed as `n` micro-batches
        (its samples cut in n along dim 0, in order), each micro-batch's loss weighted by its share
        of the samples and backpropagated before the next, so the step equals one on the whole
        batch in about 1/n of the activation memory. Schedules, clipping, the loss scale
        (16-mixed) and shared gradients act once per step, after all n. k counts steps (batches),
        as without it. To port Hugging Face's `gradient_accumulation_steps=n` with per-device
        batches of b, give batches of n·b."""
        return self._set("accumulate", n)

    def precision(self, name: str) -> Self:
        """"32", "bf16-mixed" or "16-mixed": each worker's forward and loss under autocast
        to bfloat16 or float16; 16-mixed scales the loss with each worker's own GradScaler (a step
        it skips still joins its round). Parameters, gradients, optimizer state and averaging stay float32."""
        return self._set("precision", name)

    def validation(self, data: Batches, every: int | None = 50, step: ValidationStep | None = None) -> Self:
        """Score the averaged model on `data` every `every` averagings (None: never) and at each
        epoch's end, each worker its share (batch i on worker i mod N). Metrics: val_loss and
        val_accuracy, or `step(model, batch) -> {name: batch mean}`; to `on_validation`, History."""
        self._validation, self._validation_step = compact(data), step
        return self._set("validation_every", every)

    def before_step(self, fn: BeforeStep) -> Self:
        """`fn(model, optimizer)` on each worker after backward, before the step (and before
        clipping): any gradient work, where a parameter hook would not reach the workers. In
        SHARED_GRADIENTS it sees the averaged gradients. Define it at module level."""
        if not callable(fn):
            raise ValueError(f"before_step takes a function fn(model, optimizer), got {type(fn).__name__}")
        self._before_step = fn
        return self

    def loss_fn(self, fn: LossFn) -> Self:
        """`fn(model(inputs), targets) -> scalar loss` for `(inputs, targets)` batches. Default: cross_entropy."""
        self._loss_fn, self._training_step = fn, None
        return self

    def loss_from_output(self, key: str = "loss") -> Self:
        """For a model that computes its own loss, as a Hugging Face model does given the batch's
        labels: each step calls `model(**batch)` (a mapping batch, a BatchEncoding included;
        `model(*batch)` for a tuple) and trains on `output.loss` (its `key`). The default validation
        and `evaluate()` then report the same loss (val_loss) and, where the output has `logits`
        and the batch `labels`, the accuracy of argmax(logits) (labels of -100 left out)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"loss_from_output takes the name of the output's loss, e.g. .loss_from_output('loss'); got {key!r}")
        self._training_step, self._loss_fn = OutputLoss(key), None
        return self

    def training_step(self, fn: TrainingStep) -> Self:
        """`fn(model, batch) -> scalar loss`, for batches that are not `(inputs, targets)`."""
        self._training_step, self._loss_fn = fn, None
        return self

    def listeners(self, *listeners: Any) -> Self:
        """Objects with any of `on_fit_start`, `on_score`, `on_epoch_end`, `on_fit_end`, or plain
        callables, which receive each averaged `Score`. They run in the main process."""
        self._listeners.extend(listeners)
        return self

    def workers(self, n: int) -> Self:
        """Number of workers, one process and device each. One worker on the CPU is
        the caller's own process: nothing is spawned, and batches are not copied. Ignored under
        torchrun, whose --nnodes and --nproc-per-node decide (with a warning)."""
        return self._set("workers", n)

    def prefetch_buffer(self, n: int) -> Self:
        """Batches read ahead into the spawned workers' shared queue."""
        return self._set("prefetch_buffer", n)

    def averaging_frequency(
        self, k: int | str, *, k_min: int = 1, k_max: int = 128, exchange_share: float = 0.05, payloads: Sequence[str] | None = None
    ) -> Self:
        """Local iterations per worker between two averagings. "auto": the autopilot
        chooses k in [k_min, k_max] each round, starting in their middle (16), from the measured
        seconds of a step and of an exchange, so that exchanges take at most `exchange_share` of
        the time. It runs the shortest k any way of sending allows, and at that k sends the most
        bytes that fit: one of `payloads` (default float32, bfloat16, int8) with the optimizer's
        state every round, every 2 or 4 rounds, or never, each tried and kept only if its
        measure bears it out; it never lengthens k to send more. As its last resort, where
        k_max and the fewest bytes leave the link above that share, it overlaps the rounds
        (overlap_averaging). A payload_dtype, average_updaters or overlap_averaging(False) set
        explicitly is kept. See docs/guides/autopilot.md."""
        if k == "auto":
            spec = Autopilot(k_min, k_max, exchange_share)
            return self._set("autopilot", spec if payloads is None else dataclasses.replace(spec, payloads=tuple(payloads)))
        if isinstance(k, str):
            raise ValueError(f"averaging_frequency takes an int >= 1 or 'auto', got {k!r}; e.g. .averaging_frequency(8) or .averaging_frequency('auto')")
        self._options.pop("autopilot", None)
        return self._set("averaging_frequency", k)

    def report_score_after_averaging(self, flag: bool) -> Self:
        """Report the averaged score after every averaging (True) or once per epoch."""
        return self._set("report_score_after_averaging", bool(flag))

    def average_updaters(self, flag: bool = True, every: int = 1) -> Self:
        """Average optimizer state (momentum, Adam moments, step) with the parameters.
        With `every=m` (DES-LOC, arXiv 2505.22549) it travels only in every m-th round, counted over
        the wrapper's life, each worker keeping its own in between, and wherever replicas must be
        equal: at an epoch's end, a checkpoint, a validation and a stop. E.g. `.average_updaters(every=4)`.
        Not with overlap_averaging, a coded payload, a hierarchy, replacement or a pipeline."""
        return self._set("average_updaters", bool(flag))._set("average_updaters_every", every)

    def overlap_averaging(self, flag: bool = True) -> Self:
        """Run each averaging in the background while the workers take the next round's steps,
        then add each worker's steps since to the average: no worker waits for a slower one or
        for the network, and the model a worker trains on is one round behind the average.
        Replicas are equal again at every epoch's end, checkpoint and stop."""
        return self._set("overlap_averaging", bool(flag))

    def fragments(self, n: int) -> Self:
        """With overlap_averaging: cut the averaged state into n fragments of about equal bytes;
        fragment p is sent after local step round((p + 1)·k / n) of each round and lands a round
        later (Streaming DiLoCo), so each collective carries about 1/n of the bytes and they are
        spread through the round. Replicas are equal at the same points as with one."""
        return self._set("fragments", n)

    def training_mode(self, mode: TrainingMode | str) -> Self:
        """TrainingMode.AVERAGING or TrainingMode.SHARED_GRADIENTS."""
        return self._set("training_mode", parse_enum(TrainingMode, mode, "training_mode"))

    def pipeline(self, stages: int = 2, split: Sequence[str] | None = None, microbatches: int = 1, schedule: str = "1f1b") -> Self:
        """Model parallelism inside each worker: every worker becomes a pipeline of `stages`
        processes, each holding only its layers and their optimizer state; batches go through in
        `microbatches` by the "1f1b", "gpipe" or "zbv" schedule (zero bubble: each stage holds two
        pieces of the model, in a V), and stage s averages with the other workers' stage s
        (docs/guides/pipeline.md). `split`: the layers at which stages 1.. (pieces 1.., with
        "zbv") begin, or None for about equal parameter counts."""
        names = None if split is None else tuple(split)
        return self._set("pipeline", Pipeline(stages, names, microbatches, schedule))

    def deterministic(self, flag: bool = True) -> Self:
        """Deal batch i to worker i mod N instead of first-come, so two runs give the same model
        (on a GPU, with deterministic kernels: torch.use_deterministic_algorithms). Every worker
        then waits for the slowest at each round."""
        return self._set("deterministic", bool(flag))

    def feed(self, mode: str) -> Self:
        """How spawned workers get their batches. "auto": a list or tuple of batches goes to them
        once per fit() in shared memory, so the main process copies nothing per batch, and each
        worker claims its next batch first-come from a counter in the group's store (a faster
        worker trains more of each round); with .deterministic(True), batch i goes to worker i
        mod N. So with a DataLoader over a map-style dataset with num_workers=0: the main process
        draws each epoch's sample indices from its batch sampler, and each worker loads and
        collates its own batches (the dataset goes to each worker once per fit(), so it must
        pickle). Any other data (an IterableDataset, a loader with workers of its own, a
        generator, a function), and any data with on_worker_failure("replace"), goes through the
        main process's queue. "queue": every batch through the queue, first-come unless
        .deterministic(True)."""
        return self._set("feed", mode)

    def seed(self, n: int) -> Self:
        """Seed of worker i's RNGs is `n + i`."""
        return self._set("seed", n)

    def devices(self, devices: Sequence[str | torch.device]) -> Self:
        """One device per worker, e.g. ["cuda:0", "cuda:1"]. Ignored
        under torchrun, where LOCAL_RANK picks the GPU (with a warning)."""
        if isinstance(devices, (str, torch.device)):
            raise ValueError(f"devices takes one device per worker, e.g. .devices(['cpu', 'cpu']); got {devices!r}")
        return self._set("devices", tuple(str(d) for d in devices))

    def backend(self, name: str) -> Self:
        """"auto": NCCL when every worker has a GPU of its own, else gloo; or "gloo", or
        "nccl", which build() refuses without a GPU per worker."""
        return self._set("backend", name)

    def stall_timeout(self, seconds: float) -> Self:
        """How long a spawned worker may go without progress (a batch, a step, an averaging) before fit()
        fails naming it and where it was."""
        return self._set("stall_timeout", float(seconds))

    def checkpoint(self, directory: str | os.PathLike[str], every: int = 50) -> Self:
        """Save a checkpoint to `directory` every `every` rounds, at each epoch's end, and on
        Ctrl-C. Resume with `fit(..., resume=directory)`."""
        self._set("checkpoint_every", every)
        return self._set("checkpoint_dir", os.fspath(directory))

    def on_worker_failure(self, policy: str, *, max_replacements: int = 3) -> Self:
        """"raise": a worker's failure (an error, a death, a stall) fails fit(). "replace":
        a fresh process takes the failed spawned worker's rank, every worker goes back to the last
        landed average, and the batches of the abandoned round are fed again, so that each counts
        once; up to `max_replacements` times over the wrapper's life, and a batch that fails two
        workers raises. Under torchrun use its `--max-restarts` with `.checkpoint(dir)` instead,
        or a fleet (`.fleet(store)`), whose survivors go on without a lost process."""
        self._set("max_replacements", max_replacements)
        return self._set("on_worker_failure", policy)

    def fleet(self, store: str | None, *, processes: int = 1, rescale: bool = True) -> Self:
        """Run as one process of a fleet: `processes` processes launched apart (a torchrun on each
        machine, `--nproc-per-node` of them there) that form one group in `store`, a store none
        of them hosts: etcd://HOST:PORT,HOST:PORT,...[/NAME] (an etcd cluster, so that no one
        machine's loss stops it) or tcp://HOST:PORT[/NAME] (a TCPStore). With `.on_worker_failure("replace")`
        the survivors of a lost process or machine go on without it from the last average, with
        no process restarted; the lost round's batches are claimed again. None: not a fleet.
        `processes` is the fleet as planned: while n of them are live, n < `processes`, a round
        moves the model n/`processes` of the way to its average (`rescale=False`: all the way),
        so that a sample weighs what it does in the planned fleet, and a per-step schedule counts
        global steps of `processes` processes. See docs/guides/many-machines.md."""
        self._set("fleet_rescale", rescale)
        self._set("fleet_processes", processes)
        return self._set("fleet", store)

    def auto_resume(self, flag: bool = True) -> Self:
        """Under torchrun with `.checkpoint(dir)`: a group that torchrun restarted (--max-restarts)
        resumes from the last checkpoint in `dir` by itself."""
        return self._set("auto_resume", flag)

    def peer_timeout(self, seconds: float) -> Self:
        """Under torchrun: how long a rank may hear nothing from a peer (a dead process, a cut link)
        before it exits with an error naming that peer, so that torchrun can restart the group."""
        return self._set("peer_timeout", float(seconds))

    def nan_policy(self, policy: NanPolicy | str) -> Self:
        """NanPolicy.RAISE fails fit(); NanPolicy.SKIP drops that worker from the round."""
        return self._set("nan_policy", parse_enum(NanPolicy, policy, "nan_policy"))

    def threads_per_worker(self, n: int) -> Self:
        """torch threads in each worker."""
        return self._set("threads_per_worker", n)

    def _set(self, name: str, value: Any) -> Self:
        self._options[name] = value
        return self



end_with_defaults(Settings, [d for d in OPTIONS.values() if d.name != "autopilot"])  # averaging_frequency("auto"): off unless asked for

__all__ = ["Settings"]

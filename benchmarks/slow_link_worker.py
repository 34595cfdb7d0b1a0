"""One rank of benchmarks/slow_link.py: train LeNet on MNIST under torchrun until a test accuracy.

    torchrun --nnodes 2 --node-rank R ... -m benchmarks.slow_link_worker CONTENDER [K] --out points.json

Contenders (every one trains the same model from the same init on the same batches):
  ddp          DistributedDataParallel (gloo): gradients all-reduced every step
  pma K        PyTorch's PeriodicModelAverager: local SGD, parameters averaged every K steps
  wrapper K    this project under torchrun, AVERAGING every K steps (parameters and momentum)
  wrapper-params K   the same with .average_updaters(False): parameters only, the bytes PMA sends
  wrapper-overlap K  wrapper K with .overlap_averaging(True): the averaging runs during the next K steps
  wrapper-outer K    wrapper K with an outer Nesterov SGD (--outer-lr, --outer-momentum; DiLoCo, SlowMo)
  wrapper-bf16 K     wrapper K with .payload_dtype(torch.bfloat16): deltas sent in bfloat16, error fed back
  wrapper-params-int8 K, wrapper-params-int4 K, wrapper-params-sparse K   wrapper-params K with .payload_dtype("int8"/"int4"/"sparse"):
                     block-quantized deltas, error fed back (1/4 and 1/8 of PMA's bytes, plus scales), or the
                     largest 1.56% of each 4096 (141x fewer); wrapper-params-sparse128 K: 128 of each 4096 (72x fewer)
  wrapper-encoded 1  this project with SHARED_GRADIENTS and .gradient_encoding(): threshold-encoded updates every step
  wrapper-node K     wrapper K with .hierarchy("node"): a node's ranks average gradients every step,
                     the nodes average every K (run with several ranks per node); wrapper-node-params-int8 K
                     the same sending int8 parameters alone; wrapper-node-auto the autopilot choosing the nodes' rounds
  wrapper-auto       this project with .averaging_frequency("auto") and no other lever set (no payload,
                     no average_updaters, default bounds): the autopilot picks k, the payload and the
                     optimizer state's period (and, its last resort, overlap); wrapper-auto:K bounds k
                     below by K (k_min). Every Score's choice goes in the JSON ("scores")
  wrapper-auto-sync  wrapper-auto with .overlap_averaging(False): the autopilot never overlaps
  wrapper-auto-sparse  wrapper-auto with sparse among its payloads (its lowest-bytes rung, the parameters alone)
  wrapper-auto-params  wrapper-auto with .average_updaters(False): the optimizer's state never travels
  wrapper-auto-outer   wrapper-auto with wrapper-outer's outer Nesterov SGD (DiLoCo's step, with the k the autopilot picks)
  powersgd R   DDP with PyTorch's PowerSGD comm hook, matrix_approximation_rank R, error feedback
               and warm start, compressing after --powersgd-start plain steps
  torchft-diloco K    torchft's DiLoCo, outer SGD of --outer-lr/--outer-momentum (Nesterov), sync every K
  torchft-localsgd K  torchft's LocalSGD: parameters averaged every K steps
               (each rank its own replica group; rank 0 runs the lighthouse; torchft_lenet.py)
  none         no communication: each rank trains alone on its shard (rank 0's model is scored)
  link         no training: times a one-way 10 MB send and a 10 MB all_reduce over the link

The training batches are one stream over `--max-epochs` epochs (batch 128, each epoch shuffled by
seed + epoch, the short last batch dropped so both ranks always have the same count); batch i goes
to rank i mod N (N ranks), which is the wrapper's own torchrun shard. Every `--eval-every` steps per rank
both ranks stop; rank 0 scores its replica on the 10k test images while rank 1 waits, and that
pause is kept off the training clock. After `--budget` seconds of training a run stops at its next
score, reached or not. The eval period is a multiple of K, so the averaging
contenders are scored right after an averaging. Rank 0 writes the (seconds, samples, accuracy)
points as JSON to `--out`, with where its training seconds went (`rank0_split`) and the share of
them spent communicating (`comm_fraction`): the wrapper's Scores' exchange seconds, PMA's
`average_parameters` calls, and for torchft, whose exchange runs inside the k-th step's
`optimizer.step()`, each sync step's excess over the median of the other steps.

Each score is a `fit()` of the chunk before it (`--eval-every` steps per rank): a fit's rounds
end with it, so k is at most `--eval-every` for every wrapper contender, auto included.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from benchmarks import gpt_arena, torchft_lenet
from benchmarks.common import BATCH, DEFAULT_DATA_DIR, MOMENTUM
from parallelwrapper import ParallelWrapper, TrainingMode
from parallelwrapper.app.mnist import load_mnist
from parallelwrapper.app.models import LeNet

Batch = tuple[torch.Tensor, torch.Tensor]  # images (B, 1, 28, 28) float32, labels (B,) int64
Trainer = Callable[[list[Batch]], None]  # trains this rank on its share of a chunk of batches
SEED = 123  # pw-fit's: model init and shuffling (--seed)
LINK_BYTES = 10 * 2**20
LIGHTHOUSE_PORT_OFFSET = 1000  # torchft's lighthouse listens at torchrun's master port + this


# What each wrapper contender changes in the builder.
WRAPPERS: dict[str, dict[str, Any]] = {
    "wrapper": {},
    "wrapper-params": {"average_updaters": False},  # parameters only, as PMA sends
    "wrapper-overlap": {"overlap_averaging": True},
    "wrapper-outer": {"outer": True},
    "wrapper-bf16": {"payload_dtype": torch.bfloat16},
    "wrapper-params-int8": {"average_updaters": False, "payload_dtype": "int8"},
    "wrapper-params-int4": {"average_updaters": False, "payload_dtype": "int4"},
    "wrapper-params-sparse": {"average_updaters": False, "payload_dtype": "sparse"},
    "wrapper-params-sparse128": {"average_updaters": False, "payload_dtype": "sparse:0.03125"},  # 128 of each 4096, twice the default's
    "wrapper-encoded": {"gradient_encoding": True},  # SHARED_GRADIENTS, threshold-encoded, the defaults: run as wrapper-encoded:1
    "wrapper-node": {"hierarchy": "node"},  # needs several ranks per node (slow_link.py --procs-per-node 2)
    "wrapper-node-params-int8": {"hierarchy": "node", "average_updaters": False, "payload_dtype": "int8"},
    "wrapper-auto": {"auto": True},  # .averaging_frequency("auto"), nothing else set; :K sets k_min
    "wrapper-auto-sync": {"auto": True, "overlap_averaging": False},  # the same, never overlapped
    "wrapper-auto-params": {"auto": True, "average_updaters": False},  # the same, never sending the optimizer's state
    "wrapper-auto-sparse": {"auto": True, "payloads": ("float32", "bfloat16", "int8", "sparse")},  # sparse its lowest-bytes rung
    "wrapper-auto-outer": {"auto": True, "outer": True},  # the same with an outer Nesterov SGD: torchft's DiLoCo, k chosen
    "wrapper-node-auto": {"auto": True, "hierarchy": "node"},  # the autopilot choosing the nodes' period (a node's ranks step together)
}
AUTOS = tuple(name for name, change in WRAPPERS.items() if change.get("auto"))


def batch_stream(data_dir: str, epochs: int, seed: int) -> Iterator[Batch]:
    """Every full batch of `epochs` epochs, in order; one epoch is in memory at a time."""
    train = load_mnist(data_dir, "train", download=False)
    for epoch in range(epochs):
        for x, y in train.batches(BATCH, shuffle=True, seed=seed + epoch):
            if len(y) == BATCH:  # an odd batch out would leave DDP's ranks a step apart
                yield x, y


def chunks(stream: Iterator[Batch], size: int) -> Iterator[list[Batch]]:
    while chunk := list(itertools.islice(stream, size)):
        yield chunk


class Split:
    """Where this rank's training seconds went: its steps (forward, backward, optimizer, and DDP's
    PowerSGD's and torchft's communication inside them), the periodic averagings, and the rest (the
    wrapper's per-fit work: loading the state, handing it back)."""

    def __init__(self) -> None:
        self.steps_s = self.averaging_s = 0.0
        self.step_s_each: list[float] = []  # the plain loops' steps, each (torchft's sync steps among them)
        self.scores: list[dict[str, Any]] = []  # the wrapper's Scores: what each round ran with, and its times

    def timed(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            start = time.perf_counter()
            fn()
            self.averaging_s += time.perf_counter() - start

        return run

    def on_score(self, score: Any) -> None:  # the wrapper's listener: its own split of each round
        self.steps_s += score.training_s
        self.averaging_s += score.exchange_s
        fields = ("round", "iteration", "k", "payload", "updaters_every", "overlap", "step_s", "link_s", "training_s", "exchange_s", "why")
        self.scores.append({f: getattr(score, f) for f in fields})


SPLIT = Split()


POLL_S = 0.1  # a waiting rank's look at the go file, off the clock (20 idle ranks at every 5 ms woke the machine 11k times a second)


class Turns:
    """`--turns DIR` (slow_link.py --interleave): this contender trains a chunk only when the
    driver hands it the turn, so that the race's contenders take turns chunk by chunk and a drift
    of the machine's pace over minutes falls on every one of them alike. Both ranks wait for the
    driver's `go` file to name the chunk (no collective is open while another contender trains),
    meet at a barrier off the clock, and rank 0 says in `done` what the chunk left: the training
    seconds so far (the driver steers a changing link by them) and whether it was the last."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def ready(self) -> None:
        """Set up (the wrapper built, the clocks about to start): the driver starts the turns once
        every contender is."""
        if self.folder is not None and dist.get_rank() == 0:
            self._write("ready", {})

    def wait(self, chunk: int) -> None:
        if self.folder is None:
            return
        go = self.folder / "go"
        while not (go.exists() and go.read_text() == str(chunk)):
            time.sleep(POLL_S)
        dist.barrier()

    def done(self, chunk: int, seconds: float, last: bool) -> None:
        if self.folder is not None and dist.get_rank() == 0:
            self._write("done", {"chunk": chunk, "seconds": seconds, "last": last})

    def _write(self, name: str, fields: dict[str, Any]) -> None:
        assert self.folder is not None
        part = self.folder / f"{name}.part"
        part.write_text(json.dumps(fields))
        part.replace(self.folder / name)  # whole or not at all, for the driver's reads


def local_sgd(net: nn.Module, optimizer: torch.optim.Optimizer, after_step: Callable[[], None], rank: int, world: int) -> Trainer:
    """The plain loop of ddp, pma and none: this rank's batches (i mod world), one step each."""
    after_step = SPLIT.timed(after_step)

    def train(chunk: list[Batch]) -> None:
        for x, y in chunk[rank::world]:
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            took = time.perf_counter() - start
            SPLIT.steps_s += took
            SPLIT.step_s_each.append(took)
            after_step()

    return train


def inner_optimizer(args: argparse.Namespace) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Nesterov SGD (the LeNet arena), or AdamW (the GPT arena, as in DiLoCo's inner loop)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    return torch.optim.SGD, {"lr": args.lr, "momentum": MOMENTUM, "nesterov": True}


def make_trainer(kind: str, k: int, model: nn.Module, args: argparse.Namespace, stack: contextlib.ExitStack) -> Trainer:
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind in WRAPPERS:
        # Under torchrun fit() runs this process as one worker on its shard, ends with an
        # averaging and loads the average into `model`; it reuses the process group of main().
        change = WRAPPERS[kind]
        b = ParallelWrapper.builder(model).optimizer(inner_optimizer(args)[0], **inner_optimizer(args)[1])
        if change.get("auto"):
            # Nothing else of the autopilot's levers: its payload, optimizer-state period and
            # bounds are its own (a .payload_dtype() or .average_updaters() call would fix them).
            b = b.averaging_frequency("auto", k_min=k, payloads=change.get("payloads"), exchange_share=args.exchange_share)  # wrapper-auto:K: k no lower than K (default 1)
            if "overlap_averaging" in change:
                b = b.overlap_averaging(change["overlap_averaging"])
            if "average_updaters" in change:
                b = b.average_updaters(change["average_updaters"])
        else:
            b = (
                b.averaging_frequency(k)
                .average_updaters(change.get("average_updaters", True))
                .overlap_averaging(change.get("overlap_averaging", False))
                .payload_dtype(change.get("payload_dtype", torch.float32))
            )
        b = b.hierarchy(change.get("hierarchy", "none")).threads_per_worker(1).seed(args.seed).listeners(SPLIT)  # the two "machines" share this machine's cores
        if change.get("gradient_encoding"):
            b = b.training_mode(TrainingMode.SHARED_GRADIENTS).gradient_encoding()
        if change.get("outer"):
            nesterov = args.outer_momentum > 0
            b = b.outer_optimizer(torch.optim.SGD, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=nesterov, foreach=True)
        wrapper = stack.enter_context(b.build())

        def fit(chunk: list[Batch]) -> None:
            wrapper.fit(chunk, epochs=1)

        return fit
    cls, kwargs = inner_optimizer(args)
    optimizer = cls(model.parameters(), **kwargs)
    if kind in torchft_lenet.KINDS:
        # Each rank is a replica group of its own; rank 0 runs the lighthouse, at MASTER_ADDR.
        port = int(os.environ["MASTER_PORT"]) + LIGHTHOUSE_PORT_OFFSET
        if rank == 0:
            from torchft.coordination import LighthouseServer

            server = LighthouseServer(bind=f"[::]:{port}", min_replicas=world)
            stack.callback(server.shutdown)
        dist.barrier()  # the lighthouse is up before any manager asks it for a quorum
        outer = {"lr": args.outer_lr, "momentum": args.outer_momentum, "nesterov": args.outer_momentum > 0}
        stack.enter_context(
            torchft_lenet.torchft_sync(
                kind, model, optimizer, k, lighthouse=f"http://{os.environ['MASTER_ADDR']}:{port}", replica_id=f"rank{rank}",
                replicas=world, outer=outer, host=os.environ.get("BENCH_ADDRESS", "localhost"), timeout=args.timeout,
            )
        )  # fmt: skip
        return local_sgd(model, optimizer, lambda: None, rank, world)
    if kind == "ddp":
        return local_sgd(DistributedDataParallel(model), optimizer, lambda: None, rank, world)
    if kind == "powersgd":
        ddp = DistributedDataParallel(model)
        # Plain all-reduces for the first --powersgd-start steps (PyTorch's default, 1,000, is
        # longer than this race; compressing from the start diverges at lr 0.04), then rank-R
        # compression with error feedback and warm start (Vogels et al., 2019).
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=k, start_powerSGD_iter=args.powersgd_start, use_error_feedback=True, warm_start=True, random_seed=args.seed)
        ddp.register_comm_hook(state, serial_powersgd_hook)
        return local_sgd(ddp, optimizer, lambda: None, rank, world)
    if kind == "pma":
        # Its counter starts at 0 and it averages when the counter is a multiple of the period:
        # warm-up k - 1 makes that after steps k, 2k, ..., like the wrapper, not after step 1.
        averager = PeriodicModelAverager(period=k, warmup_steps=k - 1)
        return local_sgd(model, optimizer, lambda: averager.average_parameters(model.parameters()), rank, world)
    assert kind == "none", kind
    return local_sgd(model, optimizer, lambda: None, rank, world)


def serial_powersgd_hook(state: powerSGD.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD on one bucket at a time. Each bucket's hook chains three collectives (the
    uncompressed tensors, P, Q) in callbacks that gloo runs on its own threads, so with two
    buckets in flight the ranks can issue them in different orders, which gloo aborts on ("Received
    data size doesn't match expected size"). Waiting here keeps the order; LeNet's two buckets
    lose little overlap on a CPU."""
    future = powerSGD.powerSGD_hook(state, bucket)
    future.wait()
    return future


# DDP checks the hook's annotations as objects; `from __future__ import annotations` made them strings.
serial_powersgd_hook.__annotations__ = {"state": powerSGD.PowerSGDState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


@torch.no_grad()
def accuracy(model: nn.Module, test: list[Batch]) -> float:
    model.eval()
    correct = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in test)
    model.train()
    return correct / sum(len(y) for _, y in test)


def train_to_target(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = args.arena == "gpt"
    if gpt:  # the GPT arena: a byte-level character GPT on the standard library's sources
        text, val_text = gpt_arena.corpus()
        test = gpt_arena.val_batches(val_text) if rank == 0 else []
        stream: Iterator[Batch] = gpt_arena.train_batches(text, args.batch, world * args.max_steps, args.seed)
        torch.manual_seed(args.seed)
        model: nn.Module = gpt_arena.CharGPT(args.layers, args.width, max(1, args.width // 32))
        score, reached = (lambda m: gpt_arena.val_loss(m, test)), (lambda s: s <= args.target)
    else:
        test = load_mnist(args.data_dir, "test", download=False).batches(1000) if rank == 0 else []
        stream = batch_stream(args.data_dir, args.max_epochs, args.seed)
        torch.manual_seed(args.seed)
        model = LeNet()
        score, reached = (lambda m: accuracy(m, test)), (lambda s: s >= args.target)
    points: list[dict[str, float]] = []
    seconds = eval_seconds = 0.0
    samples = steps = 0
    with contextlib.ExitStack() as stack:
        train = make_trainer(args.contender, args.k, model, args, stack)
        dist.barrier()  # start the clocks together, after the set-up (DDP's broadcast included)
        turns = Turns(args.turns)
        turns.ready()
        wall = time.perf_counter()
        for i, chunk in enumerate(chunks(stream, world * args.eval_every)):
            turns.wait(i)
            start = time.perf_counter()
            train(chunk)
            dist.barrier()  # the chunk is done when the slower rank is done
            seconds += time.perf_counter() - start
            samples += sum(len(y) for _, y in chunk)
            steps += len(chunk[rank::world])
            # Off the clock: rank 0 scores its replica while rank 1 waits for the verdict.
            start = time.perf_counter()
            # Rank 0's clock decides the budget too, so that both ranks stop after the same chunk.
            verdict = torch.tensor([score(model) if rank == 0 else 0.0, float(seconds >= args.budget)], dtype=torch.float64)
            dist.broadcast(verdict, src=0)
            eval_seconds += time.perf_counter() - start
            acc, spent = float(verdict[0]), bool(verdict[1])
            points.append({"seconds": seconds, "samples": samples, "steps": steps, ("val_loss" if gpt else "accuracy"): acc})
            if rank == 0:
                print(f"{args.contender} {args.k}: {steps} steps, {seconds:.1f} s, {'val loss' if gpt else 'accuracy'} {acc:.4f}", flush=True)
            turns.done(i, seconds, reached(acc) or spent)
            if reached(acc) or spent:
                break
        wall = time.perf_counter() - wall
    split = {"steps_s": SPLIT.steps_s, "averaging_s": SPLIT.averaging_s, "other_s": seconds - SPLIT.steps_s - SPLIT.averaging_s}
    comm, how = communicating(args.contender, args.k, seconds)
    result = {"points": points, "train_seconds": seconds, "eval_seconds": eval_seconds, "wall_seconds": wall, "rank0_split": split,
              "comm_fraction": comm, "comm_how": how}  # fmt: skip
    if SPLIT.scores:
        result["scores"] = SPLIT.scores
    if SPLIT.step_s_each:
        result["step_s_each"] = SPLIT.step_s_each
    return result


def communicating(kind: str, k: int, seconds: float) -> tuple[float | None, str]:
    """The share of rank 0's training seconds spent communicating, and how it was taken."""
    if seconds <= 0:
        return None, "no training seconds"
    if kind == "none":
        return 0.0, "no communication"
    if kind in WRAPPERS or kind == "pma":
        return SPLIT.averaging_s / seconds, "averaging seconds (Scores' exchange_s; PMA's average_parameters) / training seconds"
    if kind in torchft_lenet.KINDS:
        # The sync runs inside the k-th step's optimizer.step(): its excess over a plain step.
        each = SPLIT.step_s_each
        syncs = [t for i, t in enumerate(each) if (i + 1) % k == 0]
        plain = sorted(t for i, t in enumerate(each) if (i + 1) % k)
        if not syncs or not plain:
            return None, "no sync step or no plain step to compare"
        median = plain[len(plain) // 2]
        return sum(max(0.0, t - median) for t in syncs) / seconds, "torchft: each sync step's excess over the median plain step / training seconds"
    return None, "not measured: the collectives run inside backward()"


def measure_link() -> dict[str, float]:
    """A one-way transfer (rank 0 to rank 1) and an all_reduce, both of 10 MB of float32."""
    payload = torch.ones(LINK_BYTES // 4)  # (2.6M,)
    dist.all_reduce(torch.ones(1))  # connections up before the clock starts
    dist.barrier()
    start = time.perf_counter()
    if dist.get_rank() == 0:
        dist.send(payload, dst=1)
    else:
        dist.recv(payload, src=0)
    dist.barrier()
    one_way = time.perf_counter() - start
    start = time.perf_counter()
    dist.all_reduce(payload)
    all_reduce = time.perf_counter() - start
    return {"bytes": LINK_BYTES, "one_way_s": one_way, "one_way_mbit_s": LINK_BYTES * 8 / one_way / 1e6, "all_reduce_s": all_reduce}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("contender", choices=["ddp", "powersgd", "pma", *WRAPPERS, *torchft_lenet.KINDS, "none", "link"])
    parser.add_argument("k", type=int, nargs="?", default=1, help="averaging period (pma, wrapper); PowerSGD's rank")
    parser.add_argument("--out", type=Path, required=True, help="JSON written by rank 0")
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--arena", choices=["lenet", "gpt"], default="lenet", help="gpt: gpt_arena.py's CharGPT; --target is then a validation loss (nats/byte)")
    parser.add_argument("--batch", type=int, default=16, help="gpt arena: windows of 128 bytes per step")
    parser.add_argument("--max-steps", type=int, default=2000, help="gpt arena: steps per rank at most")
    parser.add_argument("--layers", type=int, default=7, help="gpt arena: CharGPT's layers")
    parser.add_argument("--width", type=int, default=256, help="gpt arena: CharGPT's width (heads: width / 32)")
    parser.add_argument("--budget", type=float, default=float("inf"), help="training seconds after which the run stops at its next score")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="inner optimizer (gpt arena: adamw)")
    parser.add_argument("--eval-every", type=int, default=16, help="steps per rank between evaluations")
    parser.add_argument("--lr", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=SEED, help="model init and the batches' order (slow_link.py --seed, --seed-each)")
    parser.add_argument("--powersgd-start", type=int, default=16, help="powersgd's uncompressed steps first")
    parser.add_argument("--exchange-share", type=float, default=0.05, help="the autopilot contenders' exchange_share (ρ; the library's default 0.05)")
    parser.add_argument("--outer-lr", type=float, default=1.0, help="wrapper-outer's and torchft-diloco's outer SGD")
    parser.add_argument("--outer-momentum", type=float, default=0.3, help="its Nesterov momentum")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--timeout", type=float, default=300, help="seconds any collective may take")
    parser.add_argument("--turns", type=Path, default=None, help="slow_link.py --interleave's folder: train a chunk only when it says so (Turns)")
    args = parser.parse_args(argv)
    if args.contender in ("pma", *WRAPPERS, *torchft_lenet.KINDS) and args.eval_every % args.k:
        parser.error(f"--eval-every {args.eval_every} must be a multiple of k = {args.k}, to score right after an averaging")

    torch.set_num_threads(1)  # both "machines" share this machine's cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        result = measure_link() if args.contender == "link" else train_to_target(args)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps({"contender": args.contender, "k": args.k, "lr": args.lr, "seed": args.seed, **result}, indent=2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Paired replay of the autopilot through the round loop, on a fake clock.

Time advances only by events (a step, an all-reduce's bytes, a coded send's bytes, a codec's
numbers), so every measure the loop hands the policy, and so every choice, is deterministic: the
same before and after a refactor of the loop, if the loop measures as before. Prints one JSON line
per scenario (2 gloo workers each, ~30 s in all):

    PYTHONPATH=.:tests python tests/scripts/policy_replay.py > /tmp/replay.jsonl

`policy_replay.jsonl` beside it is the output at 0a8f6f4, before issue 51 moved the autopilot's
plumbing out of the round loop; the loop after the move gives every scenario's line unchanged
(scenario by scenario: the order of the lines may differ). A change to the policy itself changes
the lines: record them again with it, and say in its note which choices moved and why. `drop`
came with the autopilot's following a link that changes (autopilot.JUMP, issue 52), the other
seven unchanged by it; before it, the loop read the fallen link's first exchange as 0.0649 s
through a mean of fast ones (it took 0.241 s) and kept int8 at k = 32 after the link came back.
Recorded again when the pilot's header part grew by its steps (9 numbers, not 8): every choice,
change and final model the same, each exchange's seconds a little longer by the header's 8 bytes
(e.g. 0.00117316 s to 0.00117332). Recorded again when it grew by the optimizer's second moments'
size (10 numbers), which a coded payload sends in full precision: every choice and final model the
same, the overlap scenario's first exchange read as 0.17 s where it read 0.169 s. Recorded again
when the autopilot stopped trading k for bytes (more bytes only where they run at the shortest k
any rung allows) and decided on a jumped measure at once: `fast` runs bfloat16's parameters at
k = 1 where it ran float32 with the state at k = 4; `adamw` int8 at k = 16 where it ran bfloat16 at
k = 32; `drop` float32 with the state every 4 rounds at k = 8 where it ran float32 at k = 16, and
moves to int8 at k = 32 a round after the fall's first measure, where the state's period would
have had it wait 4 rounds; the other five unchanged. Recorded again after the wait was fitted over
the ks it ran (1aea4fb: the pilot's checkpoint keeps each k's wait, `waits`) and a round's wait
counted at the steps it ran: `drop`'s bfloat16 trial runs at k = 4 where it ran at k = 8 (the
fitted wait's doing; the same at 5f77e4f), every other choice unchanged. Recorded again when a
wait's growth with k counted only beyond its noise (a checkpoint's waits carry their square):
every choice and final model the same, the drop scenario's mean waits within 0.2%."""

import functools
import hashlib
import json
import sys
import time
from typing import Any

import torch
from torch import nn

NOW = [0.0]
LINK = [0.0]  # the link's seconds a MB now: a scenario's "links" set it fit by fit


def fake() -> float:
    return NOW[0]


def _install(codec_ns: float) -> None:
    import torch.distributed as dist

    import parallelwrapper.averaging as averaging
    import parallelwrapper.delta_averaging as delta_averaging
    from parallelwrapper import codec, wire

    time.perf_counter = fake
    all_reduce, send_coded = dist.all_reduce, wire.send_coded

    def slow_all_reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        NOW[0] += tensor.numel() * tensor.element_size() / 1e6 * LINK[0] + 1e-4
        return all_reduce(tensor, *a, **k)

    def slow_send_coded(coder: Any, scale: float, group: Any) -> Any:
        works = send_coded(coder, scale, group)
        NOW[0] += sum(row[r].numel() * row[r].element_size() for row in coder.inbox for r in range(coder.ranks) if r != coder.rank) / 1e6 * LINK[0]
        return works

    dist.all_reduce = slow_all_reduce
    wire.send_coded = slow_send_coded
    averaging.send_coded = slow_send_coded
    delta_averaging.send_coded = slow_send_coded
    for cls in (codec.Cast, codec.Blocks, codec.Sparse):
        enc, dec = cls.encode_, cls.decode_add_

        def encode_(self, delta, *a, _enc=enc, **k):  # type: ignore[no-untyped-def]
            NOW[0] += delta.numel() * codec_ns * 1e-9
            return _enc(self, delta, *a, **k)

        def decode_add_(self, codes, scales, total, *a, _dec=dec, **k):  # type: ignore[no-untyped-def]
            NOW[0] += total.numel() * codec_ns * 1e-9
            return _dec(self, codes, scales, total, *a, **k)

        cls.encode_, cls.decode_add_ = encode_, decode_add_


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _loss(output: torch.Tensor, target: torch.Tensor, step_s: float = 0.05) -> torch.Tensor:
    NOW[0] += step_s
    return nn.functional.cross_entropy(output, target)


def _data(n: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3 + rank)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def worker(rank: int, world: int, scenario: dict[str, Any]) -> dict[str, Any]:
    from parallelwrapper.autopilot import Autopilot, levers
    from parallelwrapper.config import Config
    from parallelwrapper.job import Job
    from parallelwrapper.rounds import Rounds
    from parallelwrapper.types import Score
    from parallelwrapper.worker import Replica
    from test_round_protocol import CPU, ListSource

    _install(scenario.get("codec_ns", 0.0))
    links = scenario.get("links", [scenario.get("seconds_per_mb")] * scenario.get("fits", 2))
    opt = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), "adamw": (torch.optim.AdamW, {"lr": 1e-3})}[scenario.get("optimizer", "sgd")]
    job = Job(_model(), opt[0], opt[1], functools.partial(_loss, step_s=scenario["step_s"] * (1 + 0.2 * rank)), None)
    config = Config(**levers({"workers": world, "autopilot": Autopilot(**scenario["auto"]), **({"warmup_sync_steps": scenario["warmup"]} if "warmup" in scenario else {})}))
    out: dict[str, Any] = {"fits": []}
    own = None
    for link in links:
        LINK[0] = link
        rounds = Rounds(Replica(job.model, job, config, CPU, rank, world), config, CPU, rank, world)
        if own is not None:
            rounds.load_own_state(own)
        reports: list[Any] = []
        rounds.run(1, ListSource(_data(scenario["batches"], rank), rank, world, known=scenario.get("known", False)), reports.append)
        out["fits"].append([(s.k, s.payload, s.updaters_every, s.overlap, s.why, round(s.step_s, 9), round(s.link_s, 9), s.iteration, round(s.score, 6)) for s in reports if isinstance(s, Score)])
        own = rounds.own_state()
    pilot = own["autopilot"]
    out["changes"] = [(r, dict(c), why) for r, c, why in pilot["changes"]]
    out["links"] = {str(i): list(v) for i, v in pilot["links"].items()}
    out["step"], out["waits"] = list(pilot["step"]), {str(k): list(v) for k, v in pilot["waits"].items()}
    out["params"] = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in job.model.parameters())).hexdigest()[:16]
    return out


SCENARIOS = {
    "fast": {"seconds_per_mb": 0.01, "step_s": 0.05, "batches": 96, "auto": {"k_max": 32}},
    "slow": {"seconds_per_mb": 2.0, "step_s": 0.02, "batches": 120, "codec_ns": 2.0, "auto": {"k_max": 32}},
    "overlap": {"seconds_per_mb": 2.2, "step_s": 0.15, "batches": 48, "auto": {"k_max": 8, "payloads": ("int8",), "updater_periods": (0,)}},
    "tail": {"seconds_per_mb": 0.9, "step_s": 0.05, "batches": 22, "known": True, "fits": 1, "auto": {"k_max": 16, "exchange_share": 0.5, "payloads": ("float32",), "updater_periods": (0,)}},
    "warmup": {"seconds_per_mb": 0.2, "step_s": 0.05, "batches": 64, "warmup": 3, "auto": {"k_max": 16}},
    "codec": {"seconds_per_mb": 0.5, "step_s": 0.01, "batches": 160, "codec_ns": 400.0, "optimizer": "adamw", "auto": {"k_max": 64}},
    "adamw": {"seconds_per_mb": 0.3, "step_s": 0.03, "batches": 96, "optimizer": "adamw", "codec_ns": 5.0, "auto": {"k_max": 64}},
    # A link that falls 40x for a fit and comes back (issue 52): fits of 160 batches, as a chunked run's.
    "drop": {"links": [0.01, 0.4, 0.01], "step_s": 0.01, "batches": 160, "codec_ns": 20.0, "auto": {"k_max": 32}},
}

if __name__ == "__main__":
    from groups import run_group
    for name in (sys.argv[1:] or SCENARIOS):
        scenario = SCENARIOS[name]
        if "payloads" in scenario["auto"]:
            scenario["auto"]["payloads"] = tuple(scenario["auto"]["payloads"])
        results = run_group(worker, 2, scenario, timeout=300)
        print(json.dumps({"scenario": name, "rank0": results[0], "ranks_agree": results[0]["changes"] == results[1]["changes"], "rank1_params": results[1]["params"]}), flush=True)

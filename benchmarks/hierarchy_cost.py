"""How `.hierarchy("node")` should average across machines: three ways for two "machines" (network
namespaces joined by a shaped veth, as in slow_link.py) of two processes each, whose two ranks
hold the same state, to average it with the other machine:

    every rank   each rank all-reduces the whole state with its peer of the same local rank
    leader       local rank 0 all-reduces it with the other leader, then broadcasts it in the node
    parts        each rank all-reduces its half with its peer, then the node gathers the halves
                 (what the library does: averaging.Shards)

    sudo python benchmarks/hierarchy_cost.py --rate 100mbit --numel 862160 --repeats 5

Medians of `--repeats` timings of each, alternated, in one run. Needs root and `ip netns`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import table, write_results
from slow_link import check_privileges, slow_link

PATTERNS = ("every rank", "leader", "parts")


def measure(numel: int, repeats: int, out: Path) -> None:
    """In a torchrun worker: time each pattern, rank 0 writes the medians."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world, per_node = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    local, node = rank % per_node, rank // per_node
    nodes = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(world // per_node)]
    across = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)]
    mine, peers, leaders = nodes[node], across[local], across[0]
    state = torch.randn(-(-numel // per_node) * per_node)  # a model's numbers: zeros reduce faster

    def every_rank() -> None:
        dist.all_reduce(state, group=peers)

    def leader() -> None:
        if local == 0:
            dist.all_reduce(state, group=leaders)
        dist.broadcast(state, src=node * per_node, group=mine)

    def parts() -> None:
        halves = state.view(per_node, -1)
        dist.all_reduce(halves[local], group=peers)
        dist.all_gather(list(halves.unbind(0)), halves[local].clone(), group=mine)

    patterns = dict(zip(PATTERNS, (every_rank, leader, parts), strict=True))
    times: dict[str, list[float]] = {name: [] for name in PATTERNS}
    for i in range(repeats + 1):  # the first round warms the connections up
        for name, fn in patterns.items() if i % 2 == 0 else reversed(patterns.items()):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        out.write_text(json.dumps({name: statistics.median(t) for name, t in times.items()} | {"all": times}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--numel", type=int, default=862_160, help="numbers averaged: LeNet's parameters and momentum")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/hierarchy_cost.json")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # set in the torchrun workers
    args = parser.parse_args()
    if args.measure is not None:
        measure(args.numel, args.repeats, args.measure)
        return
    why = check_privileges()
    if why:
        sys.exit(f"hierarchy_cost.py cannot run here: {why}")
    with tempfile.TemporaryDirectory() as tmp, slow_link(args.rate) as link:
        result = Path(tmp) / "result.json"
        agents = []
        for r in range(2):
            command = [
                "ip", "netns", "exec", link.names[r], sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "2",
                "--master-addr", link.addresses[0], "--master-port", "29533", __file__,
                "--numel", str(args.numel), "--repeats", str(args.repeats), "--measure", str(result),
            ]  # fmt: skip
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.devices[r], "OMP_NUM_THREADS": "1"}
            agents.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for agent in agents:
            output, _ = agent.communicate(timeout=1800)
            if agent.returncode != 0:
                sys.exit(f"a torchrun agent failed ({agent.returncode}):\n{output.decode()[-3000:]}")
        medians = json.loads(result.read_text())
    mib = args.numel * 4 / 2**20
    rows = [[name, medians[name] * 1e3, medians[name] / medians["parts"]] for name in PATTERNS]
    print(f"2 nodes x 2 processes, {args.rate} between the nodes, {mib:.2f} MiB averaged, medians of {args.repeats}")
    print(table(["pattern", "ms per averaging", "x parts"], rows))
    write_results(args.out, {"rate": args.rate, "numel": args.numel, "repeats": args.repeats, "seconds": medians})


if __name__ == "__main__":
    main()

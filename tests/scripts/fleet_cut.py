"""A fleet member whose machine's link is cut, on emulated machines (root): its sockets stay open,
so only the heartbeat's judge can end its peers' collective (docs/guides/many-machines.md, "A loss
that closes nothing"). Three network namespaces on 1 Gbit/s links through a hub that holds the
fleet's TCPStore, a torchrun each running tests/scripts/fleet_member.py; at its 8th step the
process of rank 0 says so and trains on, and this script takes its machine's link down. The two
survivors must finish, every batch once, bitwise equal, within seconds (gloo's timeout is 330 s);
then the link comes back, and the cut member must be told the fleet went on without it, and end.
Not run by the test suite (it needs root and iproute2; tests/test_fleet.py stops a member instead).

    python tests/scripts/fleet_cut.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]
from benchmarks.fleet_soak import _serve, emulated  # noqa: E402
from benchmarks.slow_link import check_privileges  # noqa: E402
from fleet_member import BATCHES, EPOCHS  # noqa: E402


def main() -> None:
    if why := check_privileges():
        raise SystemExit(f"fleet_cut: {why}")
    out = Path(tempfile.mkdtemp(prefix="pw-fleet-cut-"))
    with emulated(3, "1gbit") as made:
        store = _serve(made, made.port, f"from torch.distributed import TCPStore\ns = TCPStore('{made.hub_address}', {made.port}, is_master=True, wait_for_workers=False)")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CUT": "1"}
        agents = []
        for m, ns in enumerate(made.names):  # gloo on the machine's own link, not the loopback its name resolves to
            command = [*made.inside(ns), sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                       str(ROOT / "tests" / "scripts" / "fleet_member.py"), f"tcp://{made.hub_address}:{made.port}/cut", "3", str(out), "0"]  # fmt: skip
            with (out / f"agent{m}.log").open("w") as log:
                agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**env, "MACHINE": str(m), "GLOO_SOCKET_IFNAME": made.devices[m]}, cwd=ROOT))
        try:
            while not (out / "cut.txt").exists():
                if any(a.poll() is not None for a in agents):
                    raise SystemExit(f"fleet_cut: a machine ended before the cut: {out}")
                time.sleep(0.05)
            cut = int((out / "cut.txt").read_text())
            made.link(cut, up=False)
            cut_at = time.time()
            survivors = [m for m in range(3) if m != cut]
            for m in survivors:
                agents[m].wait(timeout=120)
            finished = max((out / f"model{m}.pt").stat().st_mtime for m in survivors) - cut_at
            made.link(cut, up=True)
            try:
                agents[cut].wait(timeout=120)
            except subprocess.TimeoutExpired:
                print(f"fleet_cut: the cut member did not end within 120 s of its link's return (logs in {out})")
        finally:
            for a in agents:
                a.kill()
            store.kill()
    print(f"logs in {out}")
    for m in range(3):
        for line in (out / f"agent{m}.log").read_text().splitlines():
            if line.startswith("parallelwrapper: member") or "the fleet went on without" in line:
                print(f"machine {m}: {line[:300]}")
    for m in survivors:
        history = json.loads((out / f"history{m}.json").read_text())
        assert agents[m].returncode == 0 and history["epochs"][-1][1] == EPOCHS * BATCHES and history["restarts"] == 0, history
    models = [torch.load(out / f"model{m}.pt") for m in survivors]
    assert all(torch.equal(t, models[0][k]) for model in models for k, t in model.items())
    told = "the fleet went on without member" in (out / f"agent{cut}.log").read_text()
    print(f"machine {cut}'s link cut at its 8th step: the survivors finished {finished:.1f} s later, every batch once, bitwise equal; "
          f"the cut member {'was told the fleet went on without it' if told else 'was NOT told'} (exit {agents[cut].returncode})")  # fmt: skip
    if not told:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# A fleet on etcd, no single point of failure (docs/guides/many-machines.md, "A fleet: survivors go
# on"): an etcd cluster of three members on loopback, three machines of one process each, each its
# own torchrun, and a fourth that comes once a machine is lost. At its 8th step the process of rank
# 0 SIGKILLs its agent and itself, and this script then kills the etcd member "on its machine": the
# survivors must go on with two members of the store left, take the fourth machine in, train every
# batch once and end bitwise equal. Not run by the test suite (tests/test_fleet.py runs the same on a
# TCPStore): it needs etcd 3.4 with its v2 API (apt-get install etcd-server) and python-etcd.
#   bash tests/scripts/etcd_fleet.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
base=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
cluster="e0=http://127.0.0.1:$((base + 1)),e1=http://127.0.0.1:$((base + 3)),e2=http://127.0.0.1:$((base + 5))"
pids=()
for e in 0 1 2; do
    client=$((base + 2 * e)) peer=$((base + 2 * e + 1))
    etcd --name "e$e" --data-dir "$out/etcd$e" --enable-v2 --listen-client-urls "http://127.0.0.1:$client" \
        --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer" --initial-cluster "$cluster" --initial-cluster-state new \
        > "$out/etcd$e.log" 2>&1 &
    pids+=($!)
done
trap 'kill ${pids[*]} 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$out"' EXIT
sleep 3
store="etcd://127.0.0.1:$base,127.0.0.1:$((base + 2)),127.0.0.1:$((base + 4))/fleet"
launch=(python -m torch.distributed.run --standalone --nproc-per-node 1 --max-restarts 0 tests/scripts/fleet_member.py "$store" 3 "$out")
agents=()
for m in 0 1 2; do
    MACHINE=$m setsid "${launch[@]}" 0 > "$out/agent$m.log" 2>&1 &
    agents+=($!)
done
MACHINE=3 COME_AFTER="$out/lost.txt" setsid "${launch[@]}" > "$out/agent3.log" 2>&1 &
agents+=($!)
while [ ! -f "$out/lost.txt" ]; do sleep 0.05; done
kill -9 "${pids[0]}"  # the store's member on the lost machine
codes=()
for a in "${agents[@]}"; do
    if wait "$a"; then codes+=(0); else codes+=($?); fi
done
echo "agents' exit codes: ${codes[*]} (logs in $out)"
grep -h "^parallelwrapper: member" "$out"/agent*.log || true
python - "$out" <<'PY'
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, "tests/scripts")
from fleet_member import BATCHES, EPOCHS
out = Path(sys.argv[1])
histories = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("history*.json"))}
models = [torch.load(p) for p in sorted(out.glob("model*.pt"))]
assert len(histories) == 3, histories
assert all(h["epochs"][-1][1] == EPOCHS * BATCHES and h["restarts"] == 0 for h in histories.values()), histories
assert all(torch.equal(t, models[0][k]) for m in models for k, t in m.items())
print(f"3 machines finished (one of them came later), every batch once, replicas bitwise equal; etcd member e0 lost with rank 0's machine")
PY

#!/usr/bin/env bash
# The machine of rank 0 lost under an etcd rendezvous (docs/guides/many-machines.md, "A lost
# machine"): one etcd member on loopback, two torchrun agents as two machines (--nnodes 1:2), and
# at rank 0's 20th step or so its agent and its process SIGKILLed at once. The other agent forms
# the group anew alone, its worker resumes from the last checkpoint (written by two) and finishes.
# Prints the seconds from the loss to training again. Not run by the test suite, which runs the same
# with a TCPStore standing in for etcd (tests/test_torchrun_restart.py); it needs etcd 3.4 with
# its v2 API (apt-get install etcd-server) and python-etcd (pip install python-etcd).
#   bash tests/scripts/etcd_machine_loss.sh [extra --rdzv-conf entries, e.g. keep_alive_interval=1,keep_alive_max_attempt=2]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
etcd --data-dir "$out/etcd" --enable-v2 --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
    --listen-peer-urls "http://127.0.0.1:$((port + 1))" > "$out/etcd.log" 2>&1 &
etcd_pid=$!
trap 'kill $etcd_pid 2>/dev/null || true; rm -rf "$out"' EXIT
sleep 2
conf="last_call_timeout=3${1:+,$1}"
command=(python -m torch.distributed.run --nnodes 1:2 --nproc-per-node 1 --max-restarts 1 --rdzv-backend etcd-v2
    --rdzv-endpoint "127.0.0.1:$port" --rdzv-id machine-loss --rdzv-conf "$conf" tests/scripts/torchrun_restart.py machine "$out")
"${command[@]}" > "$out/agent0.log" 2>&1 &
a=$!
"${command[@]}" > "$out/agent1.log" 2>&1 &
b=$!
wait $a || true
wait $b || true
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
lost = float((out / "killed").read_text())
again = float((out / "first0.txt").read_text())
history = json.loads((out / "history0.json").read_text())
print(f"machine of rank 0 lost to training again: {again - lost:.1f} s; the survivor finished with {history['workers']} worker, "
      f"{history['rounds']} rounds, resumed: {history['scores'] < history['rounds']}")
PY

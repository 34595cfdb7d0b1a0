"""torchft's DiLoCo and LocalSGD as a benchmark peer: one replica group of one process, set up as
torchft's examples and integration tests do. Used by torchft_lenet.py (loopback) and by
slow_link_worker.py (two network namespaces).

Each replica group has its own TCPStore and a Manager (use_async_quorum=False, which DiLoCo
requires; init_sync=False, every replica starting from the same seeded model, as Manager's
docs advise then) on a torchft ProcessGroupGloo, and asks a LighthouseServer for its quorum.
torchft is a benchmark-only peer, not a dependency of this project: see MISSING.
"""

from __future__ import annotations

import datetime
import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

KINDS = ("torchft-diloco", "torchft-localsgd")
MISSING = (
    "torchft is not importable ({error}). It is a benchmark-only peer, not a dependency: "
    "pip install --no-deps torchft==0.2.0 (--no-deps keeps this torch), then its pure-python needs "
    "opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http; "
    "or leave the torchft contenders out with --contenders"
)


def version() -> str:
    """torchft's installed version; SystemExit with MISSING's advice where it does not import."""
    try:
        import torchft  # noqa: F401  (its import needs opentelemetry too)
    except ImportError as error:
        raise SystemExit(MISSING.format(error=error)) from None
    return importlib.metadata.version("torchft")


@contextmanager
def torchft_sync(
    kind: str,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    k: int,
    *,
    lighthouse: str,
    replica_id: str,
    replicas: int,
    outer: dict[str, Any],
    host: str = "localhost",
    timeout: float = 60.0,
) -> Iterator[Any]:
    """Within the block, `inner.step()` runs torchft's `kind` ("torchft-diloco": DiLoCo with an
    outer SGD of `outer`'s arguments; "torchft-localsgd": LocalSGD, parameters averaged) every `k`
    steps, among `replicas` replica groups that meet at `lighthouse`. `host` is the address the
    other groups reach this one at (its store and manager). Yields the Manager."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    if kind not in KINDS:
        raise ValueError(f"unknown torchft contender {kind!r}: use one of {', '.join(KINDS)}")

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    wait = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=replicas,
        use_async_quorum=False,
        replica_id=replica_id,
        store_addr=host,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname=host,
        timeout=wait,
        quorum_timeout=wait,
        connect_timeout=wait,
        init_sync=False,
    )
    try:
        if kind == "torchft-diloco":
            algo: Any = DiLoCo(manager, [model], inner, torch.optim.SGD(model.parameters(), **outer), sync_every=k)
        else:
            algo = LocalSGD(manager, model, inner, sync_every=k)
        with algo:
            yield manager
    finally:
        manager.shutdown(wait=False)

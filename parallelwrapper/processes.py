"""Worker processes, for training and inference: how they start, take the main process's environment, and learn it is gone.

hosts/spawned.py starts the training's, inference/pool.py the inference's.

Both pools start their workers from one `forkserver`, never a global start method: every worker
is a fresh process that imports your main module, as with spawn, but forked from a server that
imported torch once per main process, so a pool starts in a fraction of a second instead of a
second or more per worker. The server holds no thread and no CUDA context. It is started once,
by the first pool, and imports what either kind of worker needs (`_PRELOAD`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import TYPE_CHECKING

import torch.multiprocessing as mp

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext  # not on Windows

START_TIMEOUT_S = 180.0  # the most a worker process takes to start: importing torch in a fresh process on a loaded 2-core machine is slow

# What the forkserver imports before it forks a worker: both workers' code (torch with it), and
# torch._dynamo, which making any torch optimizer imports (a second, in every worker).
_PRELOAD = ["parallelwrapper.hosts.process", "parallelwrapper.inference.process", "torch._dynamo"]

# glibc's heap in a worker: blocks under 32 MiB come from the heap (glibc's own ceiling for the
# threshold it adapts), and up to 256 MiB freed at the heap's top stay mapped. Otherwise glibc
# gives a step's freed tensors back to the kernel and faults them in again at the next step:
# hundreds of page faults a step and ~5% of a LeNet step (benchmarks/results/page_faults.json). Peak memory
# is unchanged: what stays mapped was in use at the peak. PW_KEEP_HEAP=0, or glibc's own MALLOC_
# variables for these, leave glibc as it is (setting any of them stops glibc adapting the two).
_HEAP = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 << 20), "MALLOC_TRIM_THRESHOLD_": (-1, 256 << 20)}  # mallopt's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def worker_context(*also: str) -> ForkServerContext:
    """The multiprocessing context every worker starts from. (torch's, whose reducers send
    tensors through shared memory.) `also`: more modules for the server to import, where a
    harness's own processes start from it too (`python -m benchmarks quick`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *also])
    return ctx


def adopt_environment(environ: dict[str, str]) -> None:
    """In a worker process: take the environment the main process had when it started this
    worker, as a spawned process would (a forkserver's child inherits the server's, from the
    first pool); and keep glibc's heap from giving memory back every step (`keep_heap`)."""
    os.environ.clear()
    os.environ.update(environ)
    keep_heap(environ)


def keep_heap(environ: dict[str, str]) -> bool:
    """Set glibc's mmap and trim thresholds (`_HEAP`) in this process, unless `environ` has
    PW_KEEP_HEAP=0 or sets glibc's MALLOC_ variables for them (or MALLOC_TOP_PAD_). Whether it set
    them: not on a libc without mallopt (macOS; musl's is a no-op)."""
    if environ.get("PW_KEEP_HEAP") == "0" or any(name in environ for name in (*_HEAP, "MALLOC_TOP_PAD_")):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and all([mallopt(option, value) == 1 for option, value in _HEAP.values()])


def end_with_main_process() -> None:
    """In a worker process: end it at once (os._exit) when the process that started it ends,
    whatever it is doing: connecting to a store that went with the main process (which would
    wait out the store's timeout, minutes), joining, training, waiting for a command or a batch.
    Nothing it would send has a reader left. A daemon thread waits on the main process's
    sentinel, a pipe that closes when it ends (not its parent's pid: a worker started through
    the forkserver is the forkserver's child), so nothing polls."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parallelwrapper-main-watch", daemon=True).start()


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (SIGSTOP, SIGTSTP: state T in /proc); not one
    a debugger holds (t), and not where /proc cannot say (another system, a process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"  # the state follows the name's ')'


def exit_message(exitcode: int, stage: str) -> str:
    """Why a worker process ended, said from its exit code, and while doing what (`stage`)."""
    during = f" while {stage}" if stage else ""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = {
            "SIGKILL": " (out of memory? the kernel's OOM killer sends SIGKILL)",
            "SIGABRT": " (aborted: a library's C++ error or failed assertion, said on the worker's stderr above)",
            "SIGSEGV": " (a crash in native code: its stack, if any, is on the worker's stderr above)",
        }.get(name, "")
        return f"the process was killed by {name}{during}{why}"
    hint = (
        "; its own error is on stderr above. A script that trains must guard its entry point with "
        "`if __name__ == '__main__':`, because each worker imports the main module"
        if stage == "starting"
        else ""
    )
    return f"the process exited with code {exitcode}{during}{hint}"

"""Every code block in README.md and in every page under docs/ runs as written, at a small size.

Their blocks are ```python, ```bash or ```text (output, never run). A python or bash block
runs unless the HTML comment right above it says why not (`<!-- not run: REASON -->`);
`<!-- file: NAME -->` saves a python block as NAME for the commands after it, in the same page,
to run (the quick start is `quickstart.py`; names are unique across pages); `<!-- run at once, one line per machine -->` starts each command of
a block at the same time, as the torchrun agents of two machines, here both on this one: HOST0
is 127.0.0.1 and the port a free one instead of 29500.

Where they run: a fresh checkout-like directory DIR/main, holding the pages' files and a link to
this repository's examples/, beside DIR/shared/data/mnist, a small MNIST (the real files' first
1,024 training and 256 test images) that `--data-dir ../shared/data/mnist` names. README's
commands run in order in one shell, so its torchrun lines still have the quick start's
`export PW_DATA_DIR=../shared/data/mnist`: its blocks have it set. A guide's example runs on its
own and names its data itself: for its blocks $PW_DATA_DIR names a directory that does not
exist, which load_mnist refuses. `pip` is a stub that accepts the install commands README gives and nothing else: the suite
runs in the environment they make, and .ci/run runs them for real.
"""

from __future__ import annotations

import gzip
import os
import re
import socket
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TIMEOUT_S = 120
TRAIN_IMAGES, TEST_IMAGES = 1024, 256
# What the pip stub accepts: the installs of README's install, test and CUDA commands.
PIP_INSTALLS = ("install torch==2.13.0", "install -e .", "install -e .[test,docs,tensorboard,hf]")


@dataclass(frozen=True)
class Block:
    page: str  # README.md, or a page under docs/
    line: int  # where the block's code starts in the page
    language: str
    code: str
    marker: str  # the HTML comment right above the fence, or ""

    @property
    def not_run(self) -> str | None:
        """Why the block is not run, or None when it is."""
        found = re.fullmatch(r"not run: (.+)", self.marker)
        return found.group(1) if found else None

    @property
    def file(self) -> str | None:
        found = re.fullmatch(r"file: (\S+)", self.marker)
        return found.group(1) if found else None

    @property
    def commands(self) -> list[str]:
        return [line for line in self.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.commands[0].split()[0]}"


def blocks_of(path: Path) -> list[Block]:
    text, page = path.read_text(), str(path.relative_to(ROOT))
    blocks = []
    for m in re.finditer(r"(?:<!-- (.+?) -->\n)?```(\w*)\n(.*?)```", text, re.S):
        line = text.count("\n", 0, m.start(3)) + 1
        blocks.append(Block(page, line, m.group(2), m.group(3), m.group(1) or ""))
    return blocks


BLOCKS = [b for path in DOCUMENTS for b in blocks_of(path)]
RUN = [b for b in BLOCKS if b.language == "bash" and b.not_run is None]


@pytest.mark.fast
def test_every_block_runs_or_says_why_not() -> None:
    assert {b.language for b in BLOCKS} <= {"bash", "python", "text"}, "a block in another language: run it here, or make it text"
    for b in BLOCKS:
        where = f"{b.page} line {b.line}"
        if b.language == "text":
            assert not b.marker, f"{where}: output blocks take no marker"
        elif b.language == "python":
            assert b.file or b.not_run, f"{where}: a python block is a file the commands after it run"
            assert b.file is None or any(b.file in c for r in RUN if r.page == b.page and r.line > b.line for c in r.commands), f"{where}: no command after it runs {b.file}"
        else:
            assert b.marker in ("", "run at once, one line per machine") or b.not_run, f"{where}: {b.marker}"
    files = [b.file for b in BLOCKS if b.file]
    assert len(files) == len(set(files)), f"two pages save a file of the same name: {sorted(files)}"
    # README's four commands (install and train, the quick start, torchrun on one and two machines) run
    assert len([b for b in RUN if b.page == "README.md"]) == 4, [(b.line, b.commands) for b in RUN if b.page == "README.md"]


@pytest.mark.fast
def test_the_test_command_is_what_ci_runs() -> None:
    """README's test command is not run here (it is this suite); .ci/run runs exactly it."""
    command = next(b.code.strip() for b in BLOCKS if "python -m pytest" in b.code)
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == command


# -- running them ---------------------------------------------------------------------------------


def tiny_mnist(source: Path, target: Path) -> None:
    """The first images of each real file, as plain IDX files: the header's count cut to match."""
    target.mkdir(parents=True)
    for name, n in [
        ("train-images-idx3-ubyte", TRAIN_IMAGES), ("train-labels-idx1-ubyte", TRAIN_IMAGES),
        ("t10k-images-idx3-ubyte", TEST_IMAGES), ("t10k-labels-idx1-ubyte", TEST_IMAGES),
    ]:  # fmt: skip
        raw = gzip.decompress((source / f"{name}.gz").read_bytes())
        ndim = raw[3]
        header = 4 + 4 * ndim
        per_item = 28 * 28 if ndim == 3 else 1
        (target / name).write_bytes(raw[:4] + n.to_bytes(4, "big") + raw[8:header] + raw[header : header + n * per_item])


@pytest.fixture(scope="module")
def place(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DIR/main with the pages' files, examples/ and a pip stub; DIR/shared/data/mnist, small."""
    base = tmp_path_factory.mktemp("newcomer")
    tiny_mnist(mnist_dir, base / "shared" / "data" / "mnist")
    checkout = base / "main"
    checkout.mkdir()
    (checkout / "examples").symlink_to(ROOT / "examples")
    for b in BLOCKS:
        if b.file:
            (checkout / b.file).write_text(b.code)
    stub = base / "bin" / "pip"
    stub.parent.mkdir()
    accepted = " ".join(f"'{args}'" for args in PIP_INSTALLS)
    stub.write_text(f'#!/bin/sh\nfor ok in {accepted}; do [ "$*" = "$ok" ] && exit 0; done\necho "pip stub: unexpected: $*" >&2; exit 1\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return checkout


def environment(place: Path, page: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{place.parent / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    exported = place.parent / "shared" / "data" / "mnist" if page == "README.md" else place.parent / "PW_DATA_DIR-not-exported-by-this-page"
    env["PW_DATA_DIR"] = str(exported)
    env["OMP_NUM_THREADS"] = "1"  # torchrun sets it too, with a warning
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_output(block: Block, stdout: str) -> None:
    """A quick start prints its result once, on the main process, however many run it."""
    if any("quickstart.py" in c for c in block.commands):
        assert len(re.findall(r"mean training loss \d\.\d+, test accuracy \d\.\d+", stdout)) == 1, stdout
    if any(c.startswith("pip install") and "pw-fit" in c for c in block.commands):
        assert "MNIST training images: 2 workers on" in stdout and "samples/s over the wall time" in stdout, stdout


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs_as_written(block: Block, place: Path) -> None:
    env = environment(place, block.page)
    if block.marker != "run at once, one line per machine":
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=place, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert result.returncode == 0, f"{block.page} line {block.line} failed:\n{result.stdout}\n{result.stderr}"
        check_output(block, result.stdout)
        return
    port = str(free_port())
    machines = [
        subprocess.Popen(["bash", "-c", c.replace("HOST0", "127.0.0.1").replace("29500", port)], cwd=place, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in block.commands
    ]  # fmt: skip
    try:
        outputs = [m.communicate(timeout=TIMEOUT_S) for m in machines]
    finally:
        for m in machines:
            m.kill()
    for m, (stdout, stderr) in zip(machines, outputs):
        assert m.returncode == 0, f"{block.page} line {block.line}: {m.args[-1]} failed:\n{stdout}\n{stderr}"
    check_output(block, "".join(stdout for stdout, _ in outputs))

"""Paths from the environment behave like the CLI's path options: a directory that $PW_DATA_DIR
names must exist (as one that pw-fit's --data-dir names must), and the default cache is created
only when a download into it begins.

$PW_DATA_DIR is the only path the package reads from the environment (its other variables are
torchrun's ranks and PW_KEEP_HEAP, a switch). The network is always replaced here.
"""

from __future__ import annotations

import hashlib
import urllib.error
from pathlib import Path

import pytest
from click.testing import CliRunner

from parallelwrapper.app import cli
from parallelwrapper.app import mnist as mnist_module
from parallelwrapper.app.mnist import MnistError, load_mnist

pytestmark = pytest.mark.fast

TEST_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def no_network(url: str, timeout: float) -> bytes:
    raise AssertionError(f"nothing may be downloaded here, asked for {url}")


def offline(url: str, timeout: float) -> bytes:
    raise urllib.error.URLError("no route to host")


@pytest.fixture
def mirror(mnist_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The mirrors replaced by the real test files (their MD5s put in the table: the shared copies
    are re-compressed); returns the URLs asked for."""
    bodies = {name: (mnist_dir / name).read_bytes() for name in TEST_FILES}
    monkeypatch.setattr(mnist_module, "_MD5", {name: hashlib.md5(body).hexdigest() for name, body in bodies.items()})
    urls: list[str] = []

    def fetch(url: str, timeout: float) -> bytes:
        urls.append(url)
        return bodies[url.rsplit("/", 1)[1]]

    monkeypatch.setattr(mnist_module, "_fetch", fetch)
    return urls


@pytest.mark.parametrize("download", [True, False])
def test_missing_data_dir_from_env_is_an_error_naming_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, download: bool) -> None:
    typo = tmp_path / "mnsit"
    monkeypatch.setenv("PW_DATA_DIR", str(typo))
    monkeypatch.setattr(mnist_module, "_fetch", no_network)
    with pytest.raises(MnistError) as err:
        load_mnist(split="test", download=download)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"$PW_DATA_DIR names {typo}, which does not exist; set PW_DATA_DIR to the directory")
    assert "or unset it" in first and str(mnist_module.DEFAULT_CACHE_DIR) in first
    assert not typo.exists(), "the misspelled folder is not created"


def test_data_dir_from_env_that_is_a_file_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "train-images-idx3-ubyte.gz"
    a_file.write_bytes(b"")
    monkeypatch.setenv("PW_DATA_DIR", str(a_file))
    with pytest.raises(MnistError, match=r"^\$PW_DATA_DIR names .*, which is not a directory; set PW_DATA_DIR"):
        load_mnist(split="test", download=False)


def test_data_dir_from_env_with_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mnist_dir: Path) -> None:
    home = tmp_path / "home"
    (home / "mnist").mkdir(parents=True)
    for name in TEST_FILES:
        (home / "mnist" / name).write_bytes((mnist_dir / name).read_bytes())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PW_DATA_DIR", "~/mnist")
    assert mnist_module.default_data_dir() == home / "mnist"
    assert len(load_mnist(split="test", download=False)) == 10000
    monkeypatch.setenv("PW_DATA_DIR", "~/mnits")
    with pytest.raises(MnistError, match=f"names {home / 'mnits'}, which does not exist"):
        load_mnist(split="test", download=False)


def test_existing_empty_data_dir_from_env_is_downloaded_into(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mirror: list[str]) -> None:
    monkeypatch.setenv("PW_DATA_DIR", str(tmp_path))
    assert len(load_mnist(split="test")) == 10000
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(TEST_FILES) and len(mirror) == 2


def test_default_cache_is_created_only_when_a_download_begins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mirror: list[str]) -> None:
    monkeypatch.delenv("PW_DATA_DIR", raising=False)
    cache = tmp_path / "cache" / "parallelwrapper" / "mnist"
    monkeypatch.setattr(mnist_module, "DEFAULT_CACHE_DIR", cache)
    with pytest.raises(MnistError, match="download=True"):
        load_mnist(split="test", download=False)
    assert not (tmp_path / "cache").exists(), "no download, no folder"
    fetch = mnist_module._fetch
    monkeypatch.setattr(mnist_module, "_fetch", offline)
    with pytest.raises(MnistError, match="no route to host"):
        load_mnist(split="test", download=True)
    assert not (tmp_path / "cache").exists(), "a download that got nothing leaves no folder"
    monkeypatch.setattr(mnist_module, "_fetch", fetch)
    assert len(load_mnist(split="test", download=True)) == 10000
    assert sorted(p.name for p in cache.iterdir()) == sorted(TEST_FILES)


def test_pw_fit_refuses_a_missing_data_dir_from_env_as_it_does_a_missing_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    typo = tmp_path / "mnsit"
    monkeypatch.setenv("PW_DATA_DIR", str(typo))
    monkeypatch.setattr(mnist_module, "_fetch", no_network)
    runner = CliRunner()
    flag = runner.invoke(cli.main, ["--data-dir", str(typo)], prog_name="pw-fit")
    assert flag.exit_code == 2 and "does not exist" in flag.output
    env = runner.invoke(cli.main, [], prog_name="pw-fit")
    assert env.exit_code == 1 and "Traceback" not in env.output, env.output
    assert env.output.splitlines()[0].startswith(f"Error: $PW_DATA_DIR names {typo}, which does not exist")
    assert not typo.exists()
    # The flag wins over the variable: the files are looked for where it says, the variable unread.
    (tmp_path / "empty").mkdir()
    given = runner.invoke(cli.main, ["--data-dir", str(tmp_path / "empty"), "--no-download"], prog_name="pw-fit")
    assert given.exit_code == 1 and given.output.startswith(f"Error: MNIST files missing from {tmp_path / 'empty'}"), given.output

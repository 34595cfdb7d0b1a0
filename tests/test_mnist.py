"""Tests for the MNIST IDX reader: the real files, every malformed-file error, the download path.

The real files are read from /work/shared/data/mnist (or $PW_DATA_DIR); the 60k train split is
parsed once per module. Malformed files are small synthetic IDX files built in tmp_path, and the
network is always replaced: these tests never touch it.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import struct
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from parallelwrapper.app import mnist as mnist_module
from parallelwrapper.app.mnist import DEFAULT_CACHE_DIR, MnistError, MnistSplit, load_mnist

pytestmark = pytest.mark.fast

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")


@pytest.fixture(scope="module")
def train(mnist_dir: Path) -> MnistSplit:
    return load_mnist(mnist_dir, "train", download=False)


@pytest.fixture(scope="module")
def t10k(mnist_dir: Path) -> MnistSplit:
    return load_mnist(mnist_dir, "test", download=False)


def idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def write_split(
    root: Path, n: int = 6, *, n_labels: int | None = None, gz: bool = False, split: str = "test"
) -> tuple[Path, Path]:
    """A tiny valid split in ``root``: image i is filled with the value i, labelled i % 10."""
    n_labels = n if n_labels is None else n_labels
    images = np.repeat(np.arange(n, dtype=np.uint8), 28 * 28).tobytes()
    labels = (np.arange(n_labels) % 10).astype(np.uint8).tobytes()
    names = TEST_FILES if split == "test" else TRAIN_FILES
    paths = []
    bodies = (idx(IMAGES_MAGIC, (n, 28, 28), images), idx(LABELS_MAGIC, (n_labels,), labels))
    for name, body in zip(names, bodies):
        path = root / (name + ".gz" if gz else name)
        path.write_bytes(gzip.compress(body) if gz else body)
        paths.append(path)
    return paths[0], paths[1]


# The real files.


def test_train_split(train: MnistSplit) -> None:
    assert len(train) == 60000
    assert train.images.shape == (60000, 28, 28) and train.images.dtype == torch.uint8
    assert train.labels.shape == (60000,) and train.labels.dtype == torch.int64
    assert int(train.labels[0]) == 5  # the well-known first training digit
    assert set(train.labels.unique().tolist()) == set(range(10))


def test_t10k(t10k: MnistSplit) -> None:
    assert len(t10k) == 10000
    assert t10k.images.shape == (10000, 28, 28)
    assert int(t10k.labels.min()) == 0 and int(t10k.labels.max()) == 9
    assert int(t10k.labels[0]) == 7


def test_plain_files_match_gzipped(mnist_dir: Path, tmp_path: Path, t10k: MnistSplit) -> None:
    for name in TEST_FILES:
        with gzip.open(mnist_dir / f"{name}.gz") as src, open(tmp_path / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    plain = load_mnist(tmp_path, "test", download=False)
    assert torch.equal(plain.images, t10k.images)
    assert torch.equal(plain.labels, t10k.labels)


def test_plain_file_preferred_over_gzipped(tmp_path: Path) -> None:
    write_split(tmp_path)
    for name in TEST_FILES:
        (tmp_path / f"{name}.gz").write_bytes(b"not gzip at all")
    assert len(load_mnist(tmp_path, "test", download=False)) == 6


def test_gzipped_synthetic(tmp_path: Path) -> None:
    write_split(tmp_path, 4, gz=True)
    split = load_mnist(tmp_path, "test", download=False)
    assert split.labels.tolist() == [0, 1, 2, 3]
    assert int(split.images[3, 27, 27]) == 3


def test_bad_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['test', 'train'\].*'validation'"):
        load_mnist(tmp_path, "validation", download=False)


# Malformed files: each is an MnistError naming the file.


@pytest.mark.parametrize("keep", [2, 10, 16 + 28 * 28 * 6 - 1])
def test_truncated(tmp_path: Path, keep: int) -> None:
    images, _ = write_split(tmp_path)
    images.write_bytes(images.read_bytes()[:keep])
    with pytest.raises(MnistError, match="truncated|too short") as err:
        load_mnist(tmp_path, "test", download=False)
    assert str(images) in str(err.value)


def test_trailing_bytes(tmp_path: Path) -> None:
    _, labels = write_split(tmp_path)
    labels.write_bytes(labels.read_bytes() + b"\x00\x00\x00")
    with pytest.raises(MnistError, match="3 trailing bytes") as err:
        load_mnist(tmp_path, "test", download=False)
    assert str(labels) in str(err.value)


def test_wrong_magic(tmp_path: Path) -> None:
    images, labels = write_split(tmp_path)
    labels.write_bytes(struct.pack(">I", 2052) + labels.read_bytes()[4:])
    with pytest.raises(MnistError, match="magic number 2052, expected 2049") as err:
        load_mnist(tmp_path, "test", download=False)
    assert str(labels) in str(err.value)


def test_swapped_files(tmp_path: Path) -> None:
    images, labels = write_split(tmp_path)
    images_bytes, labels_bytes = images.read_bytes(), labels.read_bytes()
    images.write_bytes(labels_bytes)
    labels.write_bytes(images_bytes)
    with pytest.raises(MnistError, match="magic number 2049, expected 2051"):
        load_mnist(tmp_path, "test", download=False)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_gzip(tmp_path: Path, damage: str) -> None:
    images, _ = write_split(tmp_path, gz=True)
    body = images.read_bytes()
    if damage == "truncate":
        images.write_bytes(body[: len(body) // 2])
    else:
        images.write_bytes(body[:10] + bytes(b ^ 0xFF for b in body[10:]))
    with pytest.raises(MnistError, match="corrupt gzip") as err:
        load_mnist(tmp_path, "test", download=False)
    assert str(images) in str(err.value)


def test_count_mismatch(tmp_path: Path) -> None:
    images, labels = write_split(tmp_path, 6, n_labels=5)
    with pytest.raises(MnistError, match="6 images.*5 labels") as err:
        load_mnist(tmp_path, "test", download=False)
    assert str(images) in str(err.value) and str(labels) in str(err.value)


def test_label_out_of_range(tmp_path: Path) -> None:
    _, labels = write_split(tmp_path, 3)
    labels.write_bytes(idx(LABELS_MAGIC, (3,), bytes([1, 12, 3])))
    with pytest.raises(MnistError, match="label 12"):
        load_mnist(tmp_path, "test", download=False)


def test_split_checks_its_tensors() -> None:
    with pytest.raises(ValueError, match="uint8"):
        MnistSplit(torch.zeros(2, 28, 28), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        MnistSplit(torch.zeros(2, 28, 28, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64))


# Missing files and downloads.


def test_missing_without_download(tmp_path: Path) -> None:
    _, labels = write_split(tmp_path)
    labels.unlink()
    with pytest.raises(MnistError) as err:
        load_mnist(tmp_path, "test", download=False)
    message = str(err.value)
    assert str(tmp_path) in message and "t10k-labels-idx1-ubyte" in message
    missing = message.split(";")[0]
    assert "t10k-images" not in missing  # present files are not reported missing
    assert "data_dir=DIR to load_mnist" in message and "$PW_DATA_DIR" in message
    assert all(name in message for name in mnist_module.FILES), "the fix names all four files"
    assert "--data-dir" not in message, "the library's message names the library's argument"
    assert "download=True" in message


def test_env_var_sets_default_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "env-cache").mkdir()  # a directory the variable names must exist (tests/test_env_paths.py)
    monkeypatch.setenv("PW_DATA_DIR", str(tmp_path / "env-cache"))
    assert mnist_module.default_data_dir() == tmp_path / "env-cache"
    with pytest.raises(MnistError, match="env-cache"):
        load_mnist(split="test", download=False)
    monkeypatch.delenv("PW_DATA_DIR")
    assert mnist_module.default_data_dir() == DEFAULT_CACHE_DIR


def test_failed_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    urls: list[str] = []

    def offline(url: str, timeout: float) -> None:
        urls.append(url)
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    cache = tmp_path / "cache"
    with pytest.raises(MnistError) as err:
        load_mnist(cache, "train", download=True)
    message = str(err.value)
    assert str(cache) in message and "train-images-idx3-ubyte" in message
    assert "train-labels-idx1-ubyte" in message and "$PW_DATA_DIR" in message
    assert "no route to host" in message and "download=True" not in message  # it was tried
    assert len(urls) == 2 and all(u.endswith("train-images-idx3-ubyte.gz") for u in urls)
    assert not cache.exists()  # no partial files, and no folder, left behind


def test_checksum_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mnist_module, "_fetch", lambda url, timeout: b"not mnist")
    with pytest.raises(MnistError) as err:
        load_mnist(tmp_path, "test", download=True)
    message = str(err.value)
    assert "t10k-images-idx3-ubyte.gz" in message
    assert "9fb629c4189551a2d022fa330f9573f3" in message
    assert hashlib.md5(b"not mnist").hexdigest() in message
    assert list(tmp_path.iterdir()) == []  # the temp file is deleted


def test_download_falls_back_and_verifies(
    mnist_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, t10k: MnistSplit
) -> None:
    # The shared copies are re-compressed, so their MD5s differ from the mirrors': point the
    # table at them to exercise the happy path with real bytes.
    bodies = {f"{n}.gz": (mnist_dir / f"{n}.gz").read_bytes() for n in TEST_FILES}
    digests = {name: hashlib.md5(body).hexdigest() for name, body in bodies.items()}
    monkeypatch.setattr(mnist_module, "_MD5", digests)
    urls: list[str] = []

    def flaky(url: str, timeout: float) -> bytes:
        urls.append(url)
        if url.startswith(mnist_module._MIRRORS[0]):
            raise urllib.error.URLError("first mirror down")
        return bodies[url.rsplit("/", 1)[1]]

    monkeypatch.setattr(mnist_module, "_fetch", flaky)
    split = load_mnist(tmp_path / "new", "test", download=True)
    assert torch.equal(split.labels, t10k.labels)
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == sorted(bodies)
    assert len(urls) == 4
    load_mnist(tmp_path / "new", "test", download=True)  # now cached: no further fetches
    assert len(urls) == 4


# batches().


def test_batches_shapes_and_drop_last(train: MnistSplit) -> None:
    batches = train.batches(128)
    assert len(batches) == 469  # 60000 = 468 * 128 + 96
    x, y = batches[0]
    assert x.shape == (128, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (128,) and y.dtype == torch.int64
    assert batches[-1][0].shape[0] == 96
    assert len(train.batches(128, drop_last=True)) == 468
    assert torch.equal(torch.cat([b[1] for b in batches]), train.labels)


def test_batches_normalisation(train: MnistSplit) -> None:
    x = torch.cat([b[0] for b in train.batches(10000)])
    # The constants are the train set's own statistics.
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1.0) < 1e-3
    raw = train.batches(10000, normalize=False)[0][0]
    assert float(raw.min()) == 0.0 and float(raw.max()) == 1.0


def test_batches_shuffle(tmp_path: Path) -> None:
    write_split(tmp_path, 50)
    split = load_mnist(tmp_path, "test", download=False)

    def order(seed: int) -> torch.Tensor:
        return torch.cat([y for _, y in split.batches(8, shuffle=True, seed=seed)])

    assert torch.equal(order(3), order(3))
    assert not torch.equal(order(3), order(4))
    assert sorted(order(3).tolist()) == sorted(split.labels.tolist())
    # Images stay paired with their labels: image i is filled with i, labelled i % 10.
    for x, y in split.batches(8, shuffle=True, seed=3, normalize=False):
        assert torch.equal((x[:, 0, 0, 0] * 255).round().long() % 10, y)


def test_batches_bad_size(tmp_path: Path) -> None:
    write_split(tmp_path)
    with pytest.raises(ValueError, match="batch_size"):
        load_mnist(tmp_path, "test", download=False).batches(0)

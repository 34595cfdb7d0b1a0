"""MNIST from the standard IDX files, read with numpy; no torchvision.

The format is LeCun's (http://yann.lecun.com/exdb/mnist/): a big-endian header of a magic
number (2051 for images, 2049 for labels) and one uint32 per dimension, then the raw uint8
payload. Each of the four files may be gzipped (``.gz``) or plain. Missing files can be fetched
from the usual mirrors, checked against their published MD5s.

Every defect in a file (short, long, wrong magic, broken gzip, count mismatch) is an
``MnistError`` naming the file: a silently short dataset would only show up later as an
accuracy that is quietly wrong.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["DEFAULT_CACHE_DIR", "FILES", "MnistError", "MnistFilesMissing", "MnistSplit", "default_data_dir", "load_mnist"]

# The fallback cache, created when a download into it begins; $PW_DATA_DIR overrides it, read at
# call time in default_data_dir() so that nothing about the environment is frozen at import.
DEFAULT_CACHE_DIR: Path = Path("~/.cache/parallelwrapper/mnist").expanduser()

MNIST_MEAN: float = 0.1307
MNIST_STD: float = 0.3081

_IMAGES_MAGIC = 2051  # 0x00000803: ubyte data, 3 dimensions
_LABELS_MAGIC = 2049  # 0x00000801: ubyte data, 1 dimension
_SIDE = 28

_SPLIT_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# MD5 of the gzipped files as served by the mirrors (the digests torchvision publishes). They
# apply to downloads only: a local copy re-compressed with another gzip level has other bytes
# and the same content, so local files are validated by their headers instead.
_MD5: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}

_MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
_TIMEOUT_S = 30.0

# All four, named in every message about missing files: a directory needs them all.
FILES: tuple[str, ...] = tuple(name for names in _SPLIT_FILES.values() for name in names)


class MnistError(ValueError):
    """A missing, unreadable or malformed MNIST file; the message names the file."""


class MnistFilesMissing(MnistError):
    """Files missing from `root` and not downloaded. The message gives a library user's fix;
    `explain` words it for another caller (pw-fit names its options)."""

    def __init__(self, root: Path, missing: list[str], download_errors: list[str] | None = None) -> None:
        self.root, self.missing, self.download_errors = root, tuple(missing), tuple(download_errors or ())
        super().__init__(self.explain("pass data_dir=DIR to load_mnist", "pass download=True to fetch them"))

    def explain(self, point: str, fetch: str) -> str:
        """What is missing where, then: `point` (how to name a directory) at one holding all four
        files, or `fetch` (how to download them) when no download was tried."""
        listed = ", ".join(f"{name}[.gz]" for name in self.missing)
        text = (
            f"MNIST files missing from {self.root}: {listed}; {point} (or set $PW_DATA_DIR=DIR), where "
            f"DIR holds all four MNIST files ({', '.join(FILES)}; each gzipped or not)"
        )
        if self.download_errors:
            return f"{text}. Download failed: {'; '.join(self.download_errors)}"
        return f"{text}, or {fetch}"


@dataclass(frozen=True)
class MnistSplit:
    """One MNIST split: uint8 images (N, 28, 28) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.shape[1:] != (_SIDE, _SIDE):
            raise ValueError(
                f"images must be uint8 of shape (N, 28, 28), got {self.images.dtype} "
                f"{tuple(self.images.shape)}; build MnistSplit with load_mnist()"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must be int64 of shape ({self.images.shape[0]},), got "
                f"{self.labels.dtype} {tuple(self.labels.shape)}; "
                "build MnistSplit with load_mnist()"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        normalize: bool = True,
        drop_last: bool = False,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Split into (float32 images (B, 1, 28, 28), int64 labels (B,)) batches.

        Images are scaled to [0, 1] and, when ``normalize``, standardised with the MNIST
        mean and std. The batches are views of one converted tensor, so the whole epoch costs
        one gather and one conversion. ``shuffle`` permutes with a generator seeded by
        ``seed``: the same seed gives the same order on every worker.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}; pass a positive size")
        images, labels = self.images, self.labels
        if shuffle:
            order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
            # Gather the uint8 images before converting: a quarter of the bytes to move.
            images, labels = images.index_select(0, order), labels.index_select(0, order)
        x = images.unsqueeze(1).to(torch.float32).div_(255.0)  # (N, 1, 28, 28)
        if normalize:
            x.sub_(MNIST_MEAN).div_(MNIST_STD)
        stop = len(self) - len(self) % batch_size if drop_last else len(self)
        starts = range(0, stop, batch_size)
        return [(x[i : i + batch_size], labels[i : i + batch_size]) for i in starts]


def default_data_dir() -> Path:
    """The cache directory: $PW_DATA_DIR if set, else DEFAULT_CACHE_DIR.

    A directory that the variable names must exist, as one that pw-fit's --data-dir names must: a
    misspelled name is an MnistError here, not a new folder that a download would then fill. The
    default cache is created only when a download into it begins."""
    env = os.environ.get("PW_DATA_DIR")
    if not env:
        return DEFAULT_CACHE_DIR
    path = Path(env).expanduser()
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise MnistError(
            f"$PW_DATA_DIR names {path}, which {problem}; set PW_DATA_DIR to the directory that holds the MNIST "
            f"files (create it first to have them downloaded there), or unset it to use the cache {DEFAULT_CACHE_DIR}"
        )
    return path


def load_mnist(
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
    download: bool = True,
) -> MnistSplit:
    """Read one split ("train" or "test") from ``data_dir`` (default: default_data_dir()).

    Files missing from the directory are downloaded into it when ``download`` is true; the
    directory is created when the first file arrives.
    """
    if split not in _SPLIT_FILES:
        raise ValueError(f"split must be one of {sorted(_SPLIT_FILES)}, got {split!r}")
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    names = _SPLIT_FILES[split]
    missing = [name for name in names if _find(root, name) is None]
    if missing:
        if not download:
            raise MnistFilesMissing(root, missing)
        _download(root, missing)
    images_path, labels_path = (_find(root, name) for name in names)
    assert images_path is not None and labels_path is not None  # downloaded or raised above
    images = _read_idx(images_path, _IMAGES_MAGIC)
    labels = _read_idx(labels_path, _LABELS_MAGIC)
    if images.shape[1:] != (_SIDE, _SIDE):
        raise MnistError(f"{images_path}: images are {images.shape[1:]}, expected (28, 28)")
    if images.shape[0] != labels.shape[0]:
        raise MnistError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds "
            f"{labels.shape[0]} labels; the two files come from different splits or one is damaged"
        )
    if labels.size and int(labels.max()) > 9:
        raise MnistError(f"{labels_path}: label {int(labels.max())} is outside 0..9")
    # Copies: frombuffer arrays are read-only views of the file's bytes, and torch wants
    # writable memory; the copy also drops the reference to the raw buffer.
    return MnistSplit(
        images=torch.from_numpy(images.copy()),
        labels=torch.from_numpy(labels.astype(np.int64)),
    )


def _find(root: Path, name: str) -> Path | None:
    """The plain file if present (no decompression to pay), else the gzipped one, else None."""
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """Parse one IDX file into a uint8 array of the shape its header declares."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise MnistError(
                f"{path}: corrupt gzip stream ({err}); delete it and fetch it again"
            ) from err
    if len(raw) < 4:
        raise MnistError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise MnistError(
            f"{path}: magic number {found}, expected {magic}; this is not the right IDX file"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise MnistError(f"{path}: truncated header ({len(raw)} bytes, need {header})")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims))
    payload = len(raw) - header
    if payload < expected:
        raise MnistError(
            f"{path}: truncated, header {dims} needs {expected} payload bytes, file has {payload}"
        )
    if payload > expected:
        raise MnistError(
            f"{path}: {payload - expected} trailing bytes after the {expected} payload bytes "
            f"that header {dims} declares"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _fetch(url: str, timeout: float) -> bytes:
    """The body at ``url``; a separate function so tests can replace the network."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def _download(root: Path, missing: list[str]) -> None:
    """Fetch each missing file gzipped into ``root``, verified by MD5 and renamed atomically.
    ``root`` is created when the first file has arrived: a download that fails leaves no folder."""
    for i, name in enumerate(missing):
        gz = f"{name}.gz"
        errors: list[str] = []
        for mirror in _MIRRORS:
            try:
                body = _fetch(mirror + gz, _TIMEOUT_S)
            except (urllib.error.URLError, OSError, ValueError) as err:
                errors.append(f"{mirror + gz}: {err}")
                continue
            root.mkdir(parents=True, exist_ok=True)
            _write_verified(root / gz, body, _MD5[gz])
            break
        else:
            raise MnistFilesMissing(root, missing[i:], errors)


def _write_verified(dest: Path, body: bytes, md5: str) -> None:
    # A temp file in the same directory and a rename: a reader (another worker) never sees a
    # half-written file, and an interrupted download leaves no file that looks complete.
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(body)
        actual = hashlib.md5(body, usedforsecurity=False).hexdigest()
        if actual != md5:
            raise MnistError(
                f"{dest}: downloaded file has MD5 {actual}, expected {md5}; "
                "the mirror served other bytes, try again or fetch the file by hand"
            )
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

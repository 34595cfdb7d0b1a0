"""Datasets for the examples and tests: MNIST read from its IDX files."""

from parallelwrapper.data.mnist import DEFAULT_CACHE_DIR, MnistError, MnistSplit, load_mnist

__all__ = ["DEFAULT_CACHE_DIR", "MnistError", "MnistSplit", "load_mnist"]

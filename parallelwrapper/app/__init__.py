"""The MNIST application: `pw-fit` and its runs, comparisons and scoring, on the library's public API.

`cli` (the click commands) on `run` (one training run), `compare` (sync vs averaging, with
`communication`, the bytes its runs send) and `predict` (a saved model scored by a
ParallelInference); `options` makes their data, model and builder from `mnist` (the IDX reader)
and `models` (LeNet, an MLP). They import the library as `from parallelwrapper import ...` only;
no module of the library imports this package, and only this package imports click and matplotlib.
Nothing is imported here, so that `parallelwrapper.app.mnist` loads without click.
"""

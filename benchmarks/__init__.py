"""The maintained benchmarks, a package so that they share one harness (common.py, race.py) and
one way in (`python -m benchmarks`, __main__.py). Not part of the library: each measures it from
outside, through its public API."""

"""Benchmarks: run as modules (``python -m benchmarks.mask_build``); never part of the tests
(``tests/benchmarks`` only dry-runs ``gpu.sh`` on CPU so that it cannot rot)."""

"""Benchmarks, run from a checkout: ``flexmoba bench mask_build`` (or ``python -m benchmarks.mask_build``
from the repository root); never part of the tests (``tests/benchmarks`` only dry-runs ``gpu.sh`` on CPU).
"""

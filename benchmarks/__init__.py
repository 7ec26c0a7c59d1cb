"""Benchmarks: run as modules (``python -m benchmarks.mask_build``); never part of the tests."""

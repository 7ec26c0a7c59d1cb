"""The three ways the gate takes each slot's maximum, forced in turn.

Which one runs depends on the device and on how many scores a call ranks: ``max`` with indices
on few scores, ``max_pool2d`` on many on CPU, ``amax`` passes on many elsewhere (GPUs). Small
test problems reach only the first, and CPU runs never reach the last, so the tests that pin the
tie rule and non-finite scores run under each.
"""

import contextlib

from flexmoba import gate

# path: (gate.FEW_SCORES, gate.POOLED_MAXIMA_DEVICES)
MAXIMA_PATHS = {
    "max_indices": (2**62, ("cpu",)),
    "pooled": (0, ("cpu",)),
    "amax_passes": (0, ()),
}


@contextlib.contextmanager
def gate_settings(**values):
    """Set attributes of :mod:`flexmoba.gate` (constants, functions) for the block, then restore them (a
    context, not a fixture: hypothesis runs many examples per test call)."""
    original = {name: getattr(gate, name) for name in values}
    for name, value in values.items():
        setattr(gate, name, value)
    try:
        yield
    finally:
        for name, value in original.items():
            setattr(gate, name, value)


def maxima_path(name: str):
    """Force one maxima path. The grid gate ranks every group of query chunks as many scores:
    ``max_indices`` leaves it pooled."""
    few_scores, pooled_devices = MAXIMA_PATHS[name]
    return gate_settings(FEW_SCORES=few_scores, POOLED_MAXIMA_DEVICES=pooled_devices)

"""The three ways the gate takes each slot's maximum, forced in turn through the tuning profile.

Which one runs depends on the device and on how many scores a call ranks: ``max`` with indices
on few scores, ``max_pool2d`` on many on CPU, ``amax`` passes on many elsewhere (GPUs). Small
test problems reach only the first, and CPU runs never reach the last, so the tests that pin the
tie rule and non-finite scores run under each.
"""

from flexmoba.tuning import use_tuning

# path: the CPU profile's changes that force it
MAXIMA_PATHS = {
    "max_indices": {"few_scores": 2**62, "pooled_maxima": True},
    "pooled": {"few_scores": 0, "pooled_maxima": True},
    "amax_passes": {"few_scores": 0, "pooled_maxima": False},
}


def maxima_path(name: str, **changes):
    """Force one maxima path (with more of the profile's ``changes``). The grid gate ranks every
    group of query chunks as many scores: ``max_indices`` leaves it pooled."""
    return use_tuning("cpu", **MAXIMA_PATHS[name], **changes)

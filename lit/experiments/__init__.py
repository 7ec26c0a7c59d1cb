"""The lab's experiments over the Lightning layer: compare, scaling sweeps and reports, retrieval, gate plots."""

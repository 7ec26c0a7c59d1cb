"""Importing flexmoba and lit, and drawing their figures, leaves the process as it found it.

A fresh interpreter (run as ``python tests/test_no_global_state.py OUT``) imports the
third-party stack (torch and Lightning set warning filters of their own), records the
process-wide settings a library could change behind its caller's back, imports every module
of both packages, draws one figure of each plotting experiment on tiny made-up data, runs a
compiled flex call, and records the settings again. Each test compares one setting.
The interpreter starts on the ``pdf`` matplotlib backend, so a library switching to Agg
shows up (on a headless machine the automatic choice is Agg already).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flexmoba", "lit")
OPTIONAL = {"transformers", "lm_eval"}  # the hf and eval extras: modules needing them are skipped where missing
DEPENDENCIES = ("numpy", "torch", "lightning", "torchmetrics", "jsonargparse", "yaml", "matplotlib", "tensorboard",
                "rich", "transformers", "lm_eval.models.utils")  # lm-eval's models import urllib3: its filters
START_BACKEND = "pdf"


def snapshot() -> dict:
    """The process-wide settings under test, as plain data (``rcParams`` also by identity)."""
    import matplotlib
    import torch

    return {
        "warnings.filters": [repr(f) for f in warnings.filters],
        "matplotlib backend": matplotlib.get_backend().lower(),
        "matplotlib.rcParams identity": id(matplotlib.rcParams),
        "matplotlib.rcParams values": {k: repr(v) for k, v in matplotlib.rcParams.items()},
        "torch._dynamo.config.recompile_limit": torch._dynamo.config.recompile_limit,
        "matplotlib.pyplot imported": "matplotlib.pyplot" in sys.modules,
        "pyplot figures open": pyplot_figures(),
    }


def pyplot_figures() -> int:
    """The figures pyplot's manager holds, read without importing pyplot."""
    from matplotlib._pylab_helpers import Gcf

    return Gcf.get_num_fig_managers()


def import_everything() -> list[str]:
    """Import every module of flexmoba and lit; returns the ones skipped for a missing extra."""
    skipped = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError as error:
                if error.name not in OPTIONAL:
                    raise
                skipped.append(module.name)
    return skipped


def draw_figures(out: Path) -> None:
    """One figure from each experiment that plots: gate diagnostics, retrieval, scaling report, compare,
    context-eval (windows and passkeys), gap-closed, the continued-scaling report."""
    import torch

    from lit.experiments import (
        compare,
        context_eval,
        continued_scaling_report,
        gap_closed,
        gate_diagnostics,
        retrieval,
        scaling_report,
    )

    stats = [gate_diagnostics.LayerGateStats(kind=kind, recall=torch.tensor([0.5, 1.0]),
                                             recall_by_position=torch.linspace(0, 1, 8),
                                             distances=torch.tensor([0, 3, 1]),
                                             needle_hit=torch.tensor([0.0, 1.0]),
                                             needle_in_chunk=torch.tensor([1.0, 1.0]))
             for kind in ("moba", "full")]
    gate_diagnostics.plot_gate_stats(stats, out / "gate.png", "tiny")
    rows = [{"length": n, "depth": d, "accuracy": 0.5, "distance": 10.0, "samples": 1}
            for n in (64, 128) for d in (0.0, 1.0)]
    retrieval.heatmap(rows, out / "retrieval.png")
    sweep = out / "sweep"
    for i, compute in enumerate((1e-4, 1e-3, 1e-2)):
        for attention in ("moba", "full"):
            loss = 2.0 * compute**-0.1
            (sweep / f"s{i}-{attention}").mkdir(parents=True)
            (sweep / f"s{i}-{attention}" / "result.json").write_text(json.dumps({
                "run": f"s{i}-{attention}", "size": f"s{i}", "attention": attention, "params_non_embedding": 100,
                "tokens": 1000, "compute_6nd": compute, "compute_total": compute, "metrics": {
                    "val/loss": loss, "val/loss_trailing": loss, "val/loss_pos_000000_000064": loss}}))
    scaling_report.write_report(sweep, bootstrap=2)
    results = [{"attention": kind, "val_history": [(1, 2.0), (2, 1.5)], "windows": [[0, 8]],
                "final": {"val/loss_pos_000000_000008": 1.4}} for kind in ("moba", "full")]
    compare.plot(results, out)
    band = [{"mean": 1.0, "low": 0.9, "high": 1.1}, {"mean": 0.8, "low": 0.7, "high": 0.9}]
    cells = [{"length": n, "depth": d, "answered": 0.5} for n in (64, 128) for d in (0.1, 0.9)]
    arms = [context_eval.Arm.parse(name) for name in ("full", "moba:16:2")]
    summary = {"window": 16, "scored": [0, 1], "documents": ["a", "b"], "settings": {"seq_len": 32},
               "arms": {arm.name: {"windows": band, "windows_minus_full": band, "retrieval": cells} for arm in arms}}
    context_eval.plot(summary, arms, out)
    gap_closed.plot({"documents": ["a"], "rows": [{"window": w, "gap_before": 0.5, "gap_after": 0.2}
                                                  for w in ("0-16", "16-32")]}, out / "gap.png")
    continued_scaling_report.report(continued_scaling_report.ReportJob(
        str(REPO / "docs" / "pretrained" / "scaling" / "records"), str(out / "scaling")))


def import_dependencies() -> None:
    for name in DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            pass


def probe(out: Path) -> None:
    """Write ``before.json``, ``after.json`` and ``skipped.json`` into ``out``."""
    import_dependencies()
    before = snapshot()
    skipped = import_everything()
    draw_figures(out)
    import torch

    from flexmoba import moba_attention

    q = torch.randn(1, 2, 256, 16)
    with torch.no_grad():  # a compiled flex call: the regrouped plan through flexmoba's compiled kernel
        moba_attention(q, q, q, chunk_size=64, top_k=2, backend="flex")
    for name, value in (("before", before), ("after", snapshot()), ("skipped", skipped)):
        (out / f"{name}.json").write_text(json.dumps(value))


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("global-state")
    env = {**os.environ, "MPLBACKEND": START_BACKEND, "PYTHONWARNINGS": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    before, after = (json.loads((out / f"{name}.json").read_text()) for name in ("before", "after"))
    assert before["matplotlib backend"] == START_BACKEND  # the probe really starts off Agg
    return before, after


@pytest.mark.slow
@pytest.mark.parametrize("setting", [
    "warnings.filters",
    "matplotlib backend",
    "matplotlib.rcParams identity",
    "matplotlib.rcParams values",
    "torch._dynamo.config.recompile_limit",
    "matplotlib.pyplot imported",
    "pyplot figures open",
])
def test_library_leaves_process_state_unchanged(states, setting):
    before, after = states
    assert after[setting] == before[setting], setting


if __name__ == "__main__":
    probe(Path(sys.argv[1]))

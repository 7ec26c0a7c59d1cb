"""Every context-eval folder committed under docs/ holds the summary and tables its own records give: the
means, intervals, paired differences and passkey grids of ``results.json`` and ``results.md`` are rebuilt from
``records.jsonl`` and ``job.json`` here, so a table that disagrees with its records fails."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from lit.experiments import context_eval

REPO = Path(__file__).resolve().parents[3]
FOLDERS = sorted(p.parent for p in (REPO / "docs").glob("**/records.jsonl") if (p.parent / "job.json").is_file())


def test_the_committed_evaluations_are_found():
    assert {"training_free", "full", "moba"} <= {folder.name for folder in FOLDERS}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.relative_to(REPO / "docs").as_posix())
def test_a_committed_evaluation_is_the_one_its_records_give(folder):
    job = context_eval.ContextEvalJob(**{**json.loads((folder / "job.json").read_text()), "out": str(folder)})
    arms = [context_eval.Arm.parse(name) for name in job.arms]
    records = context_eval.read_records(folder / "records.jsonl")
    summary = context_eval.summarize(records, arms, job.window, job.scored())
    committed = json.loads((folder / "results.json").read_text())
    compared = {k: v for k, v in summary.items()
                if not (k == "scored" and "scored" not in committed and v == list(range(job.seq_len // job.window)))}
    # (a summary written before it named its scored windows scored all of them)
    assert close({k: v for k, v in committed.items() if k not in ("settings", "notes")}, compared)
    text = (folder / "results.md").read_text()
    job_line = re.search(r"^`(flexmoba context-eval[^`]*)`$", text, re.M)[1]
    machine = re.search(r"^Machine: (.*)\.$", text, re.M)[1]
    assert context_eval.markdown(summary, arms, job_line, machine, committed.get("notes", [])) == text


def close(a, b) -> bool:
    """Equal JSON values, numbers to 1e-9 relative (sums in another order differ in the last bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9,
                                                                                              abs_tol=1e-12)
    return a == b

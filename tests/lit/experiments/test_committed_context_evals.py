"""Every context-eval folder committed under docs/ holds the summary and tables its own records give: the
means, intervals, paired differences and passkey grids of ``results.json`` and ``results.md`` are rebuilt from
``records.jsonl`` and ``job.json`` here, so a table that disagrees with its records fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_continued_scaling_report import differences  # noqa: E402

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
    assert differences({k: v for k, v in committed.items() if k not in ("settings", "notes")},
                       json.loads(json.dumps(compared))) == []
    text = (folder / "results.md").read_text()
    job_line = re.search(r"^`(flexmoba context-eval[^`]*)`$", text, re.M)[1]
    machine = re.search(r"^Machine: (.*)\.$", text, re.M)[1]
    assert context_eval.markdown(summary, arms, job_line, machine, committed.get("notes", [])) == text


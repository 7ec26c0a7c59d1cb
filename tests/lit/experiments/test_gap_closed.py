"""``flexmoba gap-closed``: the share of the training-free gap that continued training closes, per window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from lit.experiments import gap_closed  # noqa: E402
from lit.training.errors import UsageError  # noqa: E402


def write_eval(folder: Path, losses: dict[str, dict[str, list[float]]]) -> Path:
    """A context-eval folder whose records hold ``losses[arm][document]`` = windows + trailing."""
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({"seq_len": 2048, "window": 1024, "trailing": 256}))
    with (folder / "records.jsonl").open("w") as f:
        for arm, documents in losses.items():
            for document, values in documents.items():
                f.write(json.dumps({"kind": "position", "arm": arm, "document": document, "windows": values[:-1],
                                    "trailing": values[-1]}) + "\n")
    return folder


@pytest.fixture
def folders(tmp_path) -> dict[str, Path]:
    documents = ["a.py", "b.py", "c.py", "d.py"]
    full = {d: [2.0 + i, 1.5 + i, 1.4 + i] for i, d in enumerate(documents)}
    gaps_before = {"a.py": 0.4, "b.py": 0.6, "c.py": 0.5, "d.py": 0.5}  # mean 0.5
    gaps_after = {"a.py": 0.1, "b.py": 0.3, "c.py": 0.2, "d.py": 0.2}  # mean 0.2: 60% closed
    before = {"full": full, "moba:512:3": {d: [full[d][0], full[d][1] + gaps_before[d], full[d][2] + gaps_before[d]]
                                           for d in documents}}
    control = {"full": {d: [v - 0.3 for v in full[d]] for d in documents}}
    moba = {"moba:512:3": {d: [full[d][0] - 0.3, full[d][1] - 0.3 + gaps_after[d], full[d][2] - 0.3 + gaps_after[d]]
                           for d in documents}}
    return {"before": write_eval(tmp_path / "before", before), "moba": write_eval(tmp_path / "moba", moba),
            "control": write_eval(tmp_path / "control", control), "out": tmp_path / "out"}


def test_the_share_closed_is_one_minus_the_gap_after_over_the_gap_before(folders):
    result = gap_closed.main([f"--{k}={v}" for k, v in folders.items()])
    late, trailing = result["rows"][1], result["rows"][2]
    for row in (late, trailing):
        assert row["gap_before"] == pytest.approx(0.5) and row["gap_after"] == pytest.approx(0.2)
        assert row["closed"] == pytest.approx(0.6) and row["low"] <= 0.6 <= row["high"] and row["low"] < row["high"]
    assert result["windows"] == ["0-1024", "1024-2048", "trailing"]
    assert result["rows"][0]["closed"] is None  # MoBA exact there: no gap to close
    assert "| trailing | +0.500 | +0.200 | 60% |" in (folders["out"] / "gap_closed.md").read_text()
    assert (folders["out"] / "gap_closed.png").stat().st_size > 0


def test_a_folder_without_the_arm_is_refused_by_name(folders):
    with pytest.raises(UsageError, match="--before: .* holds no position records of arm 'moba:256:3'"):
        gap_closed.main([*(f"--{k}={v}" for k, v in folders.items()), "--arm", "moba:256:3"])


def test_a_trailing_window_without_a_gap_ends_in_a_line_saying_so(folders, capsys):
    """MoBA exact in the trailing window too (e.g. 512/3 at 1,024 tokens): the closing line says there was
    no gap there, after writing the files."""
    path = folders["before"] / "records.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    full = {r["document"]: r["trailing"] for r in records if r["arm"] == "full"}
    for r in records:
        r["trailing"] = full[r["document"]]  # the pretrained model's MoBA equals full attention there
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = gap_closed.main([f"--{k}={v}" for k, v in folders.items()])
    assert result["rows"][-1]["closed"] is None
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "trailing window: no gap before" in line and str(folders["out"]) in line
    assert (folders["out"] / "gap_closed.md").is_file() and (folders["out"] / "gap_closed.png").is_file()


def args_of(folders: dict[str, Path], **changed) -> list[str]:
    return [f"--{k}={v}" for k, v in {**folders, **changed}.items()]


def test_an_out_that_is_a_file_is_refused(folders, tmp_path):
    (tmp_path / "a_file").write_text("not a folder\n")
    with pytest.raises(UsageError, match="--out: .*a_file is a file, not a folder"):
        gap_closed.main(args_of(folders, out=tmp_path / "a_file"))


def test_an_out_holding_output_is_refused_unless_overwrite(folders):
    gap_closed.main(args_of(folders))
    written = (folders["out"] / "gap_closed.md").read_text()
    (folders["out"] / "gap_closed.md").write_text("kept\n")
    with pytest.raises(UsageError, match="--out: .* already holds output .*; pass --overwrite true"):
        gap_closed.main(args_of(folders))
    assert (folders["out"] / "gap_closed.md").read_text() == "kept\n"
    gap_closed.main([*args_of(folders), "--overwrite", "true"])
    assert (folders["out"] / "gap_closed.md").read_text() == written


@pytest.mark.parametrize("option", ["before", "moba", "control"])
@pytest.mark.parametrize("setting, value", [("seq_len", 4096), ("window", 512), ("trailing", 128)])
def test_a_folder_scored_with_other_settings_is_refused_naming_its_option(folders, option, setting, value):
    job = json.loads((folders[option] / "job.json").read_text())
    (folders[option] / "job.json").write_text(json.dumps({**job, setting: value}))
    expected = f"--{option}: .* was scored at .*{setting} {value}.*; the others \\(.*\\) at"
    with pytest.raises(UsageError, match=expected):  # the folder the other two agree against is named
        gap_closed.main(args_of(folders))
    assert not folders["out"].exists()


@pytest.mark.parametrize("option", ["moba", "control"])
def test_a_folder_of_other_documents_is_refused_naming_its_option(folders, option):
    path = folders[option] / "records.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")  # one document fewer: a killed context-eval
    with pytest.raises(UsageError, match=f"--{option}: .* scored other documents than the others"):
        gap_closed.main(args_of(folders))
    assert not folders["out"].exists()


@pytest.mark.parametrize("option", ["before", "moba", "control"])
def test_a_folder_that_is_missing_or_a_file_or_not_a_context_eval_is_refused_naming_its_option(folders, option,
                                                                                               tmp_path):
    with pytest.raises(UsageError, match=f"--{option}: .*nowhere does not exist"):
        gap_closed.main(args_of(folders, **{option: tmp_path / "nowhere"}))
    (tmp_path / "a_file").write_text("not a folder\n")
    with pytest.raises(UsageError, match=f"--{option}: .*a_file is a file, not a folder"):
        gap_closed.main(args_of(folders, **{option: tmp_path / "a_file"}))
    (folders[option] / "job.json").unlink()
    with pytest.raises(UsageError, match=f"--{option}: .* holds no context-eval job.json"):
        gap_closed.main(args_of(folders))
    assert not folders["out"].exists()


def test_an_arm_that_is_not_a_moba_arm_is_refused(folders):
    with pytest.raises(UsageError, match="--arm: 'moba:512' is not an arm"):
        gap_closed.main([*args_of(folders), "--arm", "moba:512"])
    with pytest.raises(UsageError, match="--arm: full is not a MoBA arm"):
        gap_closed.main([*args_of(folders), "--arm", "full"])

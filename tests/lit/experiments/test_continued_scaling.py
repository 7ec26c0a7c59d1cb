"""``flexmoba continued-scaling``: every budget is an annealed branch of its arm's trunk, scored by context-eval on
the held-out documents, and a study killed mid-part resumes to the same numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from conftest import flexmoba_command, read_metrics  # noqa: E402

from flexmoba.checkpoint import read_checkpoint  # noqa: E402
from lit.cli import import_hf  # noqa: E402
from lit.experiments import continued_scaling  # noqa: E402
from lit.training.errors import UsageError  # noqa: E402

from tiny_llama import VOCAB, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LR, MIN_LR_RATIO = 1e-3, 0.1


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("continued_scaling")
    checkpoint = import_hf.main(["--source", str(save_tiny_llama(root / "hf")), "--out", str(root / "imported")])
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(f"w{(i * 13 + j * j) % VOCAB}" for j in range(300)))
    config = {
        "trainer": {"enable_progress_bar": False, "log_every_n_steps": 1},
        "checkpoint": {"every_n_train_steps": 3},  # divides no part's end but one: each still ends on a checkpoint
        "model": {"init_from": str(checkpoint), "lr": LR, "min_lr_ratio": MIN_LR_RATIO, "warmup_steps": 1,
                  "position_window": 32, "trailing_window": 32, "config": {
                      "vocab_size": VOCAB, "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
                      "head_dim": 12, "mlp_hidden": 56, "tie_embeddings": True, "rope_base": 50000.0,
                      "norm_eps": 1e-6, "max_seq_len": 256, "moba": {"chunk_size": 16, "top_k": 2, "backend": "sdpa"}}},
        "data": {"class_path": "lit.training.tokenizer.TokenFilesData", "init_args": {
            "root": str(corpus), "patterns": ["*.txt"], "seq_len": 64, "batch_size": 2, "val_fraction": 0.1,
            "test_fraction": 0.5, "tokenizer": str(root / "imported" / "tokenizer.json"),
            "cache_dir": str(root / "cache")}},
    }
    (root / "study.json").write_text(json.dumps(config))
    return {"root": root, "config": root / "study.json"}


def study_args(setup, out: Path, *extra: str) -> list[str]:
    return ["--config", str(setup["config"]), "--out", str(out), "--arms", "[full, moba:16:2]", "--budgets", "[4, 8]",
            "--decay_fraction", "0.5", "--eval_seq_len", "64", "--eval_window", "32", "--eval_trailing", "16",
            "--eval_documents", "2", "--retrieval_lengths", "[64]", "--retrieval_depths", "[0.5]",
            "--retrieval_trials", "1", *extra]


def run_study(setup, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*flexmoba_command(), "continued-scaling", *study_args(setup, out)], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def finished(setup) -> Path:
    out = setup["root"] / "whole"
    proc = run_study(setup, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def eval_records(out: Path) -> dict[tuple, dict]:
    """Every context-eval record of the study, by (arm folder, budget, record key)."""
    records = {}
    for path in sorted(out.glob("*/b*/eval/records.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            records[(path.parts[-4], path.parts[-3], r["kind"], r.get("document"), r.get("length"))] = r
    return records


def lr_of(ckpt: Path) -> float:
    return read_checkpoint(ckpt)["optimizer_states"][0]["param_groups"][0]["lr"]


def test_every_budget_is_an_annealed_branch_of_the_trunk_and_is_scored(finished):
    study = [json.loads(line) for line in (finished / "study.jsonl").read_text().splitlines()]
    assert [(r["part"], r["arm"], r["budget"]) for r in study] == [
        ("eval", "full", 0), ("eval", "moba:16:2", 0),
        *[(part, arm, budget) for budget in (4, 8) for arm in ("full", "moba:16:2")
          for part in ("trunk", "branch", "eval")]]
    for arm in ("full", "moba_16_2"):
        trunk = read_checkpoint(finished / arm / "trunk" / "checkpoints" / "last.ckpt")
        assert trunk["global_step"] == 4 and lr_of(finished / arm / "trunk" / "checkpoints" / "last.ckpt") == LR
        for budget in (4, 8):
            last = finished / arm / f"b{budget}" / "checkpoints" / "last.ckpt"
            assert read_checkpoint(last)["global_step"] == budget
            assert lr_of(last) == pytest.approx(LR * MIN_LR_RATIO)  # decayed to the end
            assert [p.name for p in last.parent.glob("*.ckpt")] == ["last.ckpt"]  # scored: the rest deleted
            trained = [int(r["step"]) for r in read_metrics(finished / arm / f"b{budget}") if r.get("train/loss")]
            assert min(trained) == budget // 2  # the branch went on from the trunk at the branch point
    records = eval_records(finished)
    documents = {key[3] for key in records if key[2] == "position"}
    assert len(documents) == 2  # the same held-out documents for every arm and budget
    assert {(k[0], k[1]) for k in records if k[2] == "position"} == {
        (arm, f"b{b}") for arm in ("full", "moba_16_2") for b in (0, 4, 8)}
    retrieval = {(k[0], k[1]) for k in records if k[2] == "retrieval"}
    assert retrieval == {(arm, b) for arm in ("full", "moba_16_2") for b in ("b0", "b8")}  # training-free and largest
    # training moved the model: the branches score otherwise than the pretrained weights
    for arm in ("full", "moba_16_2"):
        for document in documents:
            before = records[(arm, "b0", "position", document, None)]["windows"]
            assert records[(arm, "b8", "position", document, None)]["windows"] != before


@pytest.mark.slow
def test_a_study_killed_mid_part_resumes_to_the_same_numbers(setup, finished, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([*flexmoba_command(), "continued-scaling", *study_args(setup, out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mid_trunk = out / "moba_16_2" / "trunk" / "checkpoints" / "step000003.ckpt"  # inside the trunk's second part
    deadline = time.monotonic() + 300
    while not mid_trunk.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "moba_16_2" / "b8").exists()
    again = run_study(setup, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "parts done" in again.stdout and "remaining: about" in again.stdout  # the estimate from measured times
    whole, resumed = eval_records(finished), eval_records(out)
    assert whole.keys() == resumed.keys()
    for key, record in whole.items():
        assert resumed[key] == record, key


def test_the_study_s_mistakes_are_one_line_before_anything_runs(setup, tmp_path):
    cases = [
        (["--budgets", "[8, 4]"], "--budgets"),
        (["--budgets", "[1]"], "--budgets"),
        (["--decay_fraction", "1.5"], "--decay_fraction"),
        (["--arms", "[full, moba:16:2:5]"], "--arms"),
        (["--arms", "[sparse]"], "--arms"),
        (["--eval_window", "48"], "--eval_window"),
        (["--eval_documents", "0"], "--eval_documents"),
    ]
    for extra, option in cases:
        with pytest.raises(UsageError) as raised:
            continued_scaling.parse(study_args(setup, tmp_path / "x", *extra))
        assert str(raised.value).startswith(option + ": "), extra
    assert not (tmp_path / "x").exists()


def test_a_study_recorded_before_a_model_field_existed_resumes_and_other_settings_are_refused(setup, tmp_path):
    study = continued_scaling.parse(study_args(setup, tmp_path / "s"))
    continued_scaling.claim(study)
    settings = tmp_path / "s" / "study.json"
    older = json.loads(settings.read_text())
    for field in ("layer_types", "sliding_window", "qk_norm", "mlp_activation"):  # newer than the study
        del older["model"]["config"][field]
    settings.write_text(json.dumps(older))
    assert continued_scaling.claim(study) == tmp_path / "s" / "study.jsonl"
    older["model"]["config"]["qk_norm"] = True  # a model the defaults would not build
    settings.write_text(json.dumps(older))
    with pytest.raises(UsageError, match="other settings"):
        continued_scaling.claim(study)
    changed = continued_scaling.parse(study_args(setup, tmp_path / "s", "--decay_fraction", "0.25"))
    settings.write_text(json.dumps(continued_scaling.with_new_model_fields(
        {**older, "model": {**older["model"], "config": {**older["model"]["config"], "qk_norm": False}}})))
    continued_scaling.claim(study)  # the recorded settings again
    with pytest.raises(UsageError, match="other settings"):
        continued_scaling.claim(changed)


def test_a_study_resumes_from_another_working_directory(setup, tmp_path, monkeypatch):
    study = continued_scaling.parse(study_args(setup, tmp_path / "s"))
    continued_scaling.claim(study)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the checkpoint callback's default folder follows the working directory
    moved = continued_scaling.parse(study_args(setup, tmp_path / "s"))
    assert moved["checkpoint"]["dirpath"] != study["checkpoint"]["dirpath"]
    assert continued_scaling.claim(moved) == tmp_path / "s" / "study.jsonl"


def test_a_part_killed_and_resumed_keeps_the_seconds_it_ran_before(setup, tmp_path, monkeypatch):
    study = continued_scaling.parse(study_args(setup, tmp_path / "s"))
    monkeypatch.setattr(continued_scaling, "run_part", lambda study, part: None)
    first = continued_scaling.plan(study)[0]
    continued_scaling.claim(study)
    continued_scaling.note_running(tmp_path / "s", first, 500.0)  # what a run killed 500 s into it left
    continued_scaling.run(study)
    seconds = {continued_scaling.part_key(r): r["seconds"]
               for r in map(json.loads, (tmp_path / "s" / "study.jsonl").read_text().splitlines())}
    assert 500 <= seconds[continued_scaling.part_key(first)] < 510
    assert all(s < 10 for key, s in seconds.items() if key != continued_scaling.part_key(first))


def test_a_study_moved_without_its_checkpoints_trains_each_trunk_again_and_records_the_steps_it_ran(
        setup, tmp_path, monkeypatch):
    study = continued_scaling.parse(study_args(setup, tmp_path / "s"))
    monkeypatch.setattr(continued_scaling, "run_part", lambda study, part: None)
    continued_scaling.claim(study)
    plan = continued_scaling.plan(study)
    first_budget = [p for p in plan if p["budget"] in (0, 4)]  # scored, its checkpoints left on the old machine
    with open(tmp_path / "s" / "study.jsonl", "w") as records:
        for part in first_budget:
            done = {**part, "seconds": 1.0, "steps": part.get("steps", 0)}
            if part["part"] == "trunk":
                done["steps_total"] = part["steps"]
            records.write(json.dumps(done) + "\n")
    trunk_full = next(p for p in plan if p["part"] == "trunk" and p["arm"] == "full" and p["budget"] == 8)
    continued_scaling.note_running(tmp_path / "s", trunk_full, 50.0, from_step=0)  # killed once, trained from 0
    continued_scaling.run(study)
    ran = [json.loads(line) for line in (tmp_path / "s" / "study.jsonl").read_text().splitlines()]
    trunks = {r["arm"]: r for r in ran[len(first_budget):] if r["part"] == "trunk"}
    # the budget-8 trunk goes to step 4 from step 0, not from the recorded 2: 4 steps ran, as the record says
    assert {arm: (r["steps"], r["steps_total"]) for arm, r in trunks.items()} == {"full": (4, 4), "moba:16:2": (4, 4)}
    assert trunks["full"]["seconds"] >= 50 and trunks["moba:16:2"]["seconds"] < 50


def test_the_running_part_s_seconds_are_written_while_it_runs(setup, tmp_path, monkeypatch):
    study = continued_scaling.parse(study_args(setup, tmp_path / "s"))
    monkeypatch.setattr(continued_scaling, "CLOCK_SECONDS", 0.05)
    seen = []

    def slow(study, part):
        time.sleep(0.3)
        seen.append(continued_scaling.seconds_before(tmp_path / "s", part))

    monkeypatch.setattr(continued_scaling, "run_part", slow)
    continued_scaling.run(study)
    assert all(0.05 <= s <= 0.35 for s in seen), seen


def test_training_compute_counts_moba_s_sparsity_and_the_full_layers():
    study = {"model": {"config": {"n_layers": 4, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "head_dim": 32,
                                  "moba": {"chunk_size": 64, "top_k": 2}}},
             "data": {"init_args": {"seq_len": 1024}}}
    full, moba, hybrid = (continued_scaling.training_flops_per_token(study, continued_scaling.Arm.parse(a))
                          for a in ("full", "moba:64:2", "moba:64:2:2"))
    assert moba < hybrid < full
    # attention: 4 H D per attended pair, x3 for the backward; the hybrid is half MoBA layers, half full ones
    pairs_full = 1024 * 1025 / 2
    assert full - moba == pytest.approx(12 * 2 * 32 * 4 * (pairs_full - moba_pairs(1024, 64, 2)) / 1024)
    assert hybrid == pytest.approx((full + moba) / 2)


def moba_pairs(seq_len: int, chunk: int, top_k: int) -> int:
    """Causal pairs MoBA attends, counted query by query."""
    total = 0
    for q in range(seq_len):
        own = q // chunk
        total += (q - own * chunk + 1) + min(own, top_k - 1) * chunk
    return total



"""Scaling-law sweep: report from known points, a tiny real sweep, resume after a kill."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lit.experiments.scaling_report import write_report
from lit.experiments.sweep import ModelSize, Processes, SweepSpec, interpolate_log_log, print_plan

REPO = Path(__file__).resolve().parents[3]


def fake_result(folder: Path, size: str, attention: str, compute: float, losses: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({
        "run": f"{size}-{attention}", "size": size, "attention": attention, "steps": 10, "seconds": 1.0,
        "resumed": False, "params_non_embedding": 1000, "tokens": 10_000, "compute_6nd": compute,
        "compute_total": compute * 1.1, "metrics": losses,
    }))


def test_report_recovers_laws_from_fake_runs(tmp_path):
    laws = {"moba": (1.546, -0.108), "full": (1.464, -0.097)}
    for i, compute in enumerate([1e-4, 1e-3, 1e-2, 1e-1]):
        for attention, (a, b) in laws.items():
            loss = a * compute**b
            fake_result(tmp_path / f"s{i}-{attention}", f"s{i}", attention, compute,
                        {"val/loss": loss, "val/loss_trailing": loss * 0.9,
                         "val/loss_pos_000000_002048": loss * 1.1, "val/loss_pos_002048_004096": loss})
    report = write_report(tmp_path, bootstrap=50).read_text()
    assert "1.546·C^-0.108" in report and "1.464·C^-0.097" in report
    assert "positions 0-2k" in report and "positions 2k-4k" in report and "trailing window" in report
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    rows = (tmp_path / "runs.csv").read_text().splitlines()
    assert len(rows) == 9 and "val/loss_pos_002048_004096" in rows[0]
    # The two laws cross where 1.546 C^-0.108 = 1.464 C^-0.097.
    c_star = (1.464 / 1.546) ** (1 / (-0.108 + 0.097))
    assert f"{c_star:.3g}" in report


def test_sweep_config_errors_name_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"out_dir": "x", "sizes": [], "attention": {"full": {"attention": "full"}}}))
    with pytest.raises(ValueError, match="sizes"):
        SweepSpec.from_yaml(path)
    path.write_text(yaml.safe_dump({"out_dir": "x", "sizes": [{"name": "a", "n_layers": 1, "d_model": 8, "n_heads": 2}],
                                    "attention": {"full": {"attention": "full"}}, "epochs": 3}))
    with pytest.raises(ValueError, match="unknown keys.*epochs"):
        SweepSpec.from_yaml(path)


SHIPPED = sorted(p for p in (REPO / "configs" / "sweep").glob("*.yaml") if "tiny" not in p.name)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_sweep_configs_parse(path):
    spec = SweepSpec.from_yaml(path)
    assert len(spec.sizes) >= 4 and all(run.steps() >= spec.min_steps for run in spec.runs())
    for kind in spec.attention_kinds():
        sizes = [s for s in spec.sizes if kind.sizes is None or s.name in kind.sizes]
        extra = sum(len(spec.extra_seeds.get(size.name, [])) for size in sizes)
        runs = [r for r in spec.runs() if r.attention_name == kind.name]
        assert len(runs) == len(sizes) * len(spec.seeds or [0]) + extra


def long32k_spec() -> SweepSpec:
    return SweepSpec.from_yaml(REPO / "configs" / "sweep" / "long32k.yaml")


def test_long32k_is_the_papers_setting_within_two_hours(capsys):
    spec = long32k_spec()
    params = [run.compute()["params_non_embedding"] for run in spec.runs() if run.attention_name == "full"]
    assert spec.seq_len == 32768 and len(spec.sizes) >= 4 and max(params) >= 8 * min(params)
    assert spec.attention["moba"]["moba"]["chunk_size"] == 512 and spec.attention["moba"]["moba"]["top_k"] == 3
    assert len(spec.seeds) >= 2 and spec.position_window == spec.trailing_window == 2048
    minutes = print_plan(spec)
    assert minutes is not None and minutes <= 100
    assert f"estimated total: {minutes:.0f} min for {len(spec.runs())} runs" in capsys.readouterr().out


def test_seeds_hybrid_sizes_and_callbacks_make_the_runs():
    spec = long32k_spec()
    names = [run.name for run in spec.runs()]
    assert "s1-moba-seed0" in names and "s1-full-seed1" in names and "s4-hybrid-seed1" in names
    assert not any(name.startswith(("s1-hybrid", "s2-hybrid")) for name in names)  # the two largest sizes only
    runs = {run.name: run for run in spec.runs()}
    settings = runs["s3-hybrid-seed1"].settings()
    assert settings["seed_everything"] == 1 and settings["data.init_args.seed"] == 1
    switch = [c for c in settings["trainer.callbacks"] if c["class_path"].endswith("AttentionPhaseSwitch")]
    assert len(switch) == 1 and switch[0]["init_args"] == {"switch_to_full_at": 0.9}
    assert any("GateDiagnostics" in c["class_path"] for c in runs["s4-moba-seed0"].settings()["trainer.callbacks"])
    assert runs["s4-moba-seed1"].settings()["trainer.callbacks"] == []
    assert "model.config.sizes" not in settings  # run settings are not model fields
    moba, hybrid, full = (runs[f"s4-{a}-seed0"].compute()["compute_total"] for a in ("moba", "hybrid", "full"))
    assert hybrid == pytest.approx(0.9 * moba + 0.1 * full)
    assert runs["s4-moba-seed0"].compute()["compute_6nd"] == runs["s4-full-seed0"].compute()["compute_6nd"]


def test_extra_seeds_add_runs_of_their_size_only():
    spec = SweepSpec(out_dir="x", sizes=[ModelSize("a", 1, 16, 2), ModelSize("b", 1, 32, 2)],
                     attention={"moba": {"attention": "moba"}, "full": {"attention": "full"}},
                     seeds=[0, 1], extra_seeds={"b": [2]})
    names = [run.name for run in spec.runs()]
    assert names[-2:] == ["b-moba-seed2", "b-full-seed2"] and len(names) == 10
    assert not any(name.startswith("a-") and name.endswith("seed2") for name in names)


def test_no_seeds_keeps_the_old_run_names():
    spec = SweepSpec.from_yaml(REPO / "configs" / "sweep" / "toy.yaml")
    assert [run.name for run in spec.runs()][:2] == ["s1-moba", "s1-full"]
    assert "seed_everything" not in spec.runs()[0].settings()


def test_step_time_interpolation_is_log_log():
    points = [[100, 1.0], [400, 4.0], [1600, 8.0]]
    assert interpolate_log_log(points, 200) == pytest.approx(2.0)  # slope 1 between 100 and 400
    assert interpolate_log_log(points, 800) == pytest.approx(8.0 / 2**0.5)  # slope 1/2 above 400
    assert interpolate_log_log(points, 3200) == pytest.approx(8.0 * 2**0.5)  # the last slope, extended
    assert interpolate_log_log(points, 50) == pytest.approx(0.5)


@pytest.mark.parametrize("change, message", [
    ({"attention": {"h": {"attention": "moba", "sizes": ["nope"]}}}, "unknown sizes"),
    ({"attention": {"h": {"attention": "moba", "switch_to_full_at": 1.5}}}, "switch_to_full_at"),
    ({"gate_diagnostics": ["a-moba-seed7"]}, "gate_diagnostics"),
    ({"extra_seeds": {"b": [1]}}, "extra_seeds names unknown size"),
    ({"extra_seeds": {"a": [0]}}, "extra_seeds of 'a' must add seeds"),
])
def test_run_settings_name_what_exists(tmp_path, change, message):
    raw = {"out_dir": "x", "sizes": [{"name": "a", "n_layers": 1, "d_model": 16, "n_heads": 2}],
           "attention": {"moba": {"attention": "moba"}}, "seeds": [0], **change}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=message):
        SweepSpec.from_yaml(path)


def test_processes_come_from_torchrun_and_srun_tasks_are_refused(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert Processes.from_env() == Processes(1, 0, 1)
    monkeypatch.setenv("SLURM_NTASKS", "8")  # srun started 8 copies, none knowing its rank
    with pytest.raises(RuntimeError, match="one torchrun per node"):
        Processes.from_env()
    monkeypatch.setenv("WORLD_SIZE", "8")  # torchrun inside an allocation
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    processes = Processes.from_env()
    assert processes == Processes(8, 5, 4) and not processes.is_main


def test_the_sweep_batch_is_global_and_split_over_the_processes():
    spec = SweepSpec(out_dir="x", sizes=[ModelSize("a", 1, 16, 2)], attention={"full": {"attention": "full"}},
                     batch_size=8)
    assert Processes().launch_settings(spec) == {}
    assert Processes(8, 0, 4).launch_settings(spec) == {"trainer.devices": 4, "trainer.num_nodes": 2,
                                                        "data.init_args.batch_size": 1}
    with pytest.raises(ValueError, match="global batch"):
        Processes(3, 0, 3).launch_settings(spec)


def tiny_spec(tmp_path: Path, corpus_cache: Path) -> Path:
    spec = {
        "out_dir": str(tmp_path / "sweep"),
        "seq_len": 128, "batch_size": 2, "tokens_per_parameter": 0.0, "min_steps": 2,
        "position_window": 32, "trailing_window": 32, "limit_val_batches": 1,
        "base_config": str(REPO / "configs" / "moba.yaml"),
        "sizes": [{"name": "a", "n_layers": 1, "d_model": 16, "n_heads": 2},
                  {"name": "b", "n_layers": 1, "d_model": 32, "n_heads": 2}],
        "attention": {"moba": {"attention": "moba", "moba": {"chunk_size": 32, "top_k": 2, "backend": "sdpa"}},
                      "full": {"attention": "full"}},
        "cli_args": ["--data.max_files", "6", "--data.cache_dir", str(corpus_cache),
                     "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_killed_sweep_resumes_without_redoing_finished_runs(tmp_path, corpus_cache):
    config = tiny_spec(tmp_path, corpus_cache)
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "lit.cli.main", "sweep", str(config)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    first = sweep / "a-moba" / "result.json"
    deadline = time.time() + 240
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # as a crash or a pulled plug would
    proc.wait()
    assert first.exists(), proc.stdout.read().decode()[-3000:]
    first_written = first.read_text()
    assert not (sweep / "b-full" / "result.json").exists(), "the kill should land before the sweep ends"

    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "a-moba: done, skipped" in done.stdout
    assert first.read_text() == first_written
    results = [json.loads((sweep / f"{s}-{a}" / "result.json").read_text()) for s in "ab" for a in ("moba", "full")]
    assert all("val/loss" in r["metrics"] and r["steps"] == 2 for r in results)
    report = (sweep / "report.md").read_text()
    assert "moba" in report and "full" in report and (sweep / "scaling.png").exists()

    # Changing the sweep's settings must not silently mix old runs into a new study.
    spec = yaml.safe_load(config.read_text())
    spec["seq_len"] = 64
    config.write_text(yaml.safe_dump(spec))
    changed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert changed.returncode != 0 and "finished under other settings" in changed.stderr


def sweep_rows(sweep: Path) -> list[dict]:
    with open(sweep / "runs.csv") as f:
        return list(csv.DictReader(f))


def assert_same_runs(got: list[dict], expected: list[dict]) -> None:
    """The same runs, columns and settings; metrics equal to fp32 noise; wall time apart."""
    assert [list(r) for r in got] == [list(r) for r in expected]
    for row, want in zip(got, expected, strict=True):
        for column, value in want.items():
            if column == "seconds":
                continue
            if column.startswith(("val/", "compute_")):
                assert float(row[column]) == pytest.approx(float(value), rel=1e-4), (row["run"], column)
            else:
                assert row[column] == value, (row["run"], column)


@pytest.mark.slow
def test_two_process_sweep_writes_the_runs_of_a_one_process_sweep(tmp_path, corpus_cache):
    """Under torchrun every run is one DDP job; rank 0 alone plans, prints and writes."""
    config = tiny_spec(tmp_path, corpus_cache)
    spec = yaml.safe_load(config.read_text())
    spec["sizes"] = spec["sizes"][:1]  # two tiny runs: a-moba, a-full
    spec["cli_args"] += ["--trainer.accelerator", "cpu"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    launcher = {1: [sys.executable], 2: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node", "2"]}

    def sweep(processes: int, timeout: int = 600) -> subprocess.CompletedProcess:
        spec["out_dir"] = str(tmp_path / f"sweep-{processes}")
        path = tmp_path / f"sweep-{processes}.yaml"
        path.write_text(yaml.safe_dump(spec))
        command = [*launcher[processes], "-m", "lit.cli.main", "sweep", str(path)]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    for processes in (1, 2):
        done = sweep(processes)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for line in ("a-moba: starting", "a-full: starting", "sweep done: report "):
        assert done.stdout.count(line) == 1, done.stdout  # printed by rank 0 only
    assert_same_runs(sweep_rows(tmp_path / "sweep-2"), sweep_rows(tmp_path / "sweep-1"))

    # A refusal decided on rank 0 ends the whole 2-process sweep, with its message.
    spec["seq_len"] = 64
    changed = sweep(2, timeout=180)
    assert changed.returncode != 0 and "finished under other settings" in changed.stderr


def test_a_sweep_names_each_attention_whose_moba_cannot_be_sparse():
    from lit.experiments.sweep import moba_notes

    spec = SweepSpec(out_dir="unused", seq_len=512, sizes=[ModelSize("s0", 2, 32, 2), ModelSize("s1", 2, 64, 2)],
                     attention={"wide": {"attention": "moba", "moba": {"chunk_size": 256, "top_k": 2}},
                                "sparse": {"attention": "moba", "moba": {"chunk_size": 64, "top_k": 3}},
                                "full": {"attention": "full"}})
    assert moba_notes(spec) == ["note: wide: MoBA at seq_len 512 with chunk_size 256 × top_k 2 attends every earlier "
                                "key (equals full attention); lower chunk_size or top_k to make it sparse"]


@pytest.mark.slow
def test_a_sweep_says_once_at_the_start_what_data_it_reads_and_which_moba_cannot_be_sparse(tmp_path, corpus_cache):
    spec = yaml.safe_load(tiny_spec(tmp_path, corpus_cache).read_text())
    spec["attention"] = {"wide": {"attention": "moba", "moba": {"chunk_size": 64, "top_k": 2, "backend": "sdpa"}}}
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "lit.cli.main", "sweep", str(tmp_path / "wide.yaml")], cwd=REPO,
                          capture_output=True, encoding="utf-8", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    note = ("flexmoba: note: wide: MoBA at seq_len 128 with chunk_size 64 × top_k 2 attends every earlier key "
            "(equals full attention); lower chunk_size or top_k to make it sparse")
    data = [line for line in lines if line.startswith("flexmoba: data: ")]
    assert lines.count(note) == 1 and len(data) == 2, lines  # two runs, said once
    assert data[0].startswith("flexmoba: data: ") and "sequences of 128 bytes: train 6 files" in data[0], data
    assert data[1].startswith("flexmoba: data: max_files 6 keeps ") and data[1].endswith(
        "long enough; add --data.max_files=null to the sweep config's cli_args to use them all"), data

"""The parts of ``benchmarks/gpu.sh`` on their own, at tiny sizes on CPU, without compiling flex:
each one's verdict can fail."""

import csv
import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
from flex_standin import flex_standin

from benchmarks import attention, gpu_check, gpu_flash, gpu_mfu, gpu_timing
from benchmarks.gpu_check import Shape, check, not_timed
from benchmarks.gpu_determinism import compare_runs
from benchmarks.gpu_mfu import fit_command, last_values, metrics_csv, mfu_summary
from benchmarks.verdict import verdict
from flexmoba import moba_reference, use_flex_attention

CPU = torch.device("cpu")
MOBA = Shape(batch=1, heads=2, kv_heads=1, seq_len=256, head_dim=16, chunk_size=64, top_k=2)
CAUSAL = dataclasses.replace(MOBA, chunk_size=0, top_k=0)
TINY_TIMING = ["--device", "cpu", "--seq_lens", "256", "--configs", "64:2", "--heads", "2", "--kv_heads", "1",
               "--head_dim", "16", "--dtype", "float32", "--repeats", "2"]


def test_a_verdict_is_one_line(capsys):
    assert verdict("part", "FAIL", "first\nsecond") == 1
    assert verdict("part", "SKIP", "why") == 0
    assert capsys.readouterr().out == "VERDICT part FAIL first second\nVERDICT part SKIP why\n"
    with pytest.raises(ValueError, match="status"):
        verdict("part", "TIMEOUT", "the script's, never a part's")


# -- oracle -------------------------------------------------------------------------------------


def test_the_oracle_check_passes_the_timed_runners():
    for method, shape in (("moba_gather", MOBA), ("sdpa_causal", CAUSAL)):
        record = check(method, shape, "float32", CPU)
        assert record["ok"] and record["backward"] and set(record["errors"]) == {"out", "dq", "dk", "dv"}, record


def test_the_compact_union_check_runs_both_masks_through_one_kernel():
    """CUDA-only in gpu.sh (compiled CPU flex refuses compact tables); here the stand-in kernel runs it."""
    with use_flex_attention(flex_standin):
        record = check("union_compact", Shape(1, 2, 1, 256, 16, 16, 2), "float32", CPU)
    assert record["ok"] and record["errors"]["out"] == 0.0, record


def test_the_oracle_check_fails_a_wrong_method(monkeypatch):
    def non_causal(case):
        def forward(q, k, v):
            return F.scaled_dot_product_attention(q, attention.expand_kv(q, k), attention.expand_kv(q, v))
        return attention.Runner(forward, None, None, backward_ok=True)

    def one_chunk_too_many(case):
        return attention.moba_runner(dataclasses.replace(case, top_k=case.top_k + 1))

    monkeypatch.setattr(gpu_check, "baseline_runner", non_causal)
    monkeypatch.setattr(gpu_check, "moba_runner", one_chunk_too_many)
    for method, shape in (("sdpa_causal", CAUSAL), ("moba_gather", MOBA)):
        record = check(method, shape, "float32", CPU)
        assert not record["ok"] and record["errors"]["out"] > record["tolerance"], record


def test_an_oracle_check_that_raises_is_a_failed_check(monkeypatch):
    def broken(case):
        raise RuntimeError("planted")

    monkeypatch.setattr(gpu_check, "moba_runner", broken)
    record = check("moba_gather", MOBA, "float32", CPU)
    assert not record["ok"] and record["error"] == "RuntimeError: planted"
    assert gpu_check.summary([record])[0] == "FAIL"


def checks_file(tmp_path, passing: list[str], failing: list[str]):
    def record(method, ok):
        return {"method": method, "shape": MOBA.label, "dtype": "float32", "tolerance": 5e-3, "backward": True,
                "errors": {"out": 1e-7 if ok else 0.5}, "ok": ok, "error": None}
    path = tmp_path / "checks.json"
    gpu_check.write([record(m, True) for m in passing] + [record(m, False) for m in failing], "cpu", path)
    return path


def test_methods_without_a_passing_check_are_not_timed(tmp_path):
    path = checks_file(tmp_path, passing=["sdpa_causal"], failing=["moba_gather"])
    why = not_timed(path, ["sdpa_causal", "moba_gather", "moba_flex"])
    assert set(why) == {"moba_gather", "moba_flex"}
    assert why["moba_gather"].startswith("not timed: failed its oracle check (moba_gather float32")
    assert why["moba_flex"] == "not timed: no oracle check ran"
    missing = not_timed(tmp_path / "absent.json", ["sdpa_causal"])
    assert missing["sdpa_causal"].startswith("not timed: no oracle checks")


def test_a_method_that_fails_its_check_is_reported_not_timed(tmp_path, capsys):
    path = checks_file(tmp_path, passing=["sdpa_causal"], failing=["moba_gather"])
    argv = ["--checks", str(path), *TINY_TIMING, "--methods", "sdpa_causal", "moba_gather", "--out", str(tmp_path)]
    assert gpu_timing.main(argv) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "attention_cpu.json").read_text())["rows"]
            if r.get("table") == "attention"}
    assert "fwd_ms" in rows["sdpa_causal"] and "fwd_bwd_ms" in rows["sdpa_causal"]
    assert "fwd_ms" not in rows["moba_gather"]
    assert rows["moba_gather"]["note"].startswith("not timed: failed its oracle check")
    assert "not timed: failed its oracle check" in (tmp_path / "attention_cpu.md").read_text()
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("VERDICT timing PASS timed 1 of 2 rows; moba_gather not timed: failed")


def test_a_timing_row_that_raises_is_reported_and_fails_the_part(tmp_path, monkeypatch, capsys):
    path = checks_file(tmp_path, passing=["sdpa_causal", "moba_gather"], failing=[])

    def broken(case):
        raise RuntimeError("planted")

    monkeypatch.setattr(attention, "moba_runner", broken)
    argv = ["--checks", str(path), *TINY_TIMING, "--methods", "sdpa_causal", "moba_gather", "--out", str(tmp_path)]
    assert gpu_timing.main(argv) == 1
    assert "VERDICT timing FAIL timed 1 of 2 rows; moba_gather S256 64/2: error: RuntimeError: planted" in \
        capsys.readouterr().out


# -- determinism --------------------------------------------------------------------------------


def test_determinism_is_bitwise():
    x = torch.randn(4, 4)
    x[1, 1] = float("nan")
    assert compare_runs(lambda: [x.clone(), x.clone()])[0] == "PASS"
    one_ulp = x.clone()
    one_ulp[0, 0] = torch.nextafter(one_ulp[0, 0], torch.tensor(float("inf")))
    runs = iter([[x.clone(), x.clone()], [x.clone(), one_ulp]])
    status, why = compare_runs(lambda: next(runs))
    assert status == "FAIL" and "dq max |diff|" in why and "out" not in why


# -- Triton vs FLASH ----------------------------------------------------------------------------


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, attention.expand_kv(q, k), attention.expand_kv(q, v), is_causal=True)


def test_the_backend_comparison_flags_a_backend_that_disagrees():
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(4))

    def oracle(q, k, v):
        return moba_reference(q, k, v, chunk_size=128, top_k=1)

    def scaled(factor):  # out, dq, dk and dv all off by the factor
        return lambda q, k, v: causal_sdpa(q, k, v) * factor

    same = gpu_flash.compare("causal", {"A": causal_sdpa, "B": causal_sdpa}, oracle, q, k, v, grad, backward=True,
                             repeats=2)
    assert same["ok"] and same["A vs B"] == 0 and same["A vs oracle"] < 1e-5 and same["B ms"] > 0
    # Each backend within tolerance of the oracle, yet 4% apart: the comparison with each other fails.
    apart = gpu_flash.compare("causal", {"A": scaled(1.02), "B": scaled(0.98)}, oracle, q, k, v, grad, backward=True,
                              repeats=2)
    assert apart["A vs oracle"] < gpu_flash.TOLERANCE and apart["B vs oracle"] < gpu_flash.TOLERANCE
    assert not apart["ok"] and apart["A vs B"] > gpu_flash.TOLERANCE
    # Both backends agree with each other, both wrong: the oracle fails them.
    wrong = gpu_flash.compare("causal", {"A": scaled(1.1), "B": scaled(1.1)}, oracle, q, k, v, grad, backward=True,
                              repeats=2)
    assert wrong["A vs B"] == 0 and not wrong["ok"] and wrong["A vs oracle"] > gpu_flash.TOLERANCE

    def broken(q, k, v):
        raise NotImplementedError("planted")

    failed = gpu_flash.compare("causal", {"A": causal_sdpa, "B": broken}, oracle, q, k, v, grad, backward=True)
    assert not failed["ok"] and failed["error"] == "NotImplementedError: planted"


@pytest.mark.skipif(gpu_flash.flash_import_error() is None, reason="flash_attn.cute imports here")
def test_flash_is_not_available_without_flash_attn(capsys):
    assert gpu_flash.main(["--device", "cpu"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("VERDICT flash SKIP not available: flash_attn.cute does not import (")


# -- MFU ----------------------------------------------------------------------------------------


def write_metrics(path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True)
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)


def test_mfu_is_read_from_the_newest_metrics_csv(tmp_path):
    key = "throughput/train/device/"
    write_metrics(tmp_path / "csv/version_2/metrics.csv", [{key + "flops_per_sec": 1.0}])
    write_metrics(tmp_path / "csv/version_10/metrics.csv", [
        {key + "flops_per_sec": 5e13, key + "items_per_sec": 1e5, "train/loss": 3.0},
        {"train/loss": 2.5},  # the newest row without throughput: earlier values stay
        {key + "flops_per_sec": 1e14, key + "items_per_sec": 2e5, key + "mfu": 0.05},
        {key + "items_per_sec": ""},
    ])
    path = metrics_csv(tmp_path)
    assert path.parent.name == "version_10"
    values = last_values(path)
    assert values == {"flops_per_sec": 1e14, "items_per_sec": 2e5, "mfu": 0.05}
    status, why = mfu_summary(values, "NVIDIA H200", "cuda")
    assert status == "PASS" and why.startswith("MFU 10.11% (2e+05 tokens/s, 100 model TFLOP/s / 989 dense")
    assert "Lightning's mfu 5.00%" in why
    assert metrics_csv(tmp_path / "nothing") is None


def test_mfu_verdicts():
    flops = {"flops_per_sec": 1e14, "items_per_sec": 1.0}
    assert mfu_summary({}, "NVIDIA H200", "cuda")[0] == "FAIL"
    assert mfu_summary(flops, "NVIDIA B200", "cuda")[0] == "FAIL"
    assert mfu_summary(flops, "NVIDIA H200 NVL", "cuda")[1].startswith("MFU 11.98%")
    assert mfu_summary(flops, "NVIDIA H100 PCIe", "cuda")[1].startswith("MFU 13.23%")
    status, why = mfu_summary(flops, "CPU x", "cpu")
    assert status == "PASS" and "no MFU on a CPU" in why


def test_the_fit_is_this_checkouts_flexmoba_with_trainer_flags_only(tmp_path):
    entry = re.search(r'^flexmoba\s*=\s*"([\w.]+):(\w+)"', (gpu_mfu.REPO / "pyproject.toml").read_text(), re.M)
    for device in ("cuda", "cpu"):
        command = fit_command(["configs/moba.yaml", "configs/tiny.yaml"], 7, torch.device(device), tmp_path)
        assert command[:2] == [gpu_mfu.sys.executable, "-c"] and f"from {entry[1]} import {entry[2]}" in command[2]
        args = command[command.index("fit") + 1:]
        flags = args[::2]
        assert flags[:2] == ["--config", "--config"] and args[1::2][:2] == ["configs/moba.yaml", "configs/tiny.yaml"]
        assert all(flag.startswith("--trainer.") for flag in flags[2:]), flags
        options = dict(zip(flags, args[1::2], strict=True))
        assert options["--trainer.max_steps"] == "7" and options["--trainer.default_root_dir"] == str(tmp_path)
        assert options["--trainer.accelerator"] == ("gpu" if device == "cuda" else "cpu")
        assert ("--trainer.precision" in options) == (device == "cuda")


def test_the_scaling_part_runs_the_study_s_own_config_at_the_gpu_s_length(tmp_path, monkeypatch):
    from benchmarks import gpu_scaling
    from lit.experiments import continued_scaling

    monkeypatch.setattr("lit.training.checks.available", lambda kind: True)  # parsed as on the GPU's machine
    args = gpu_scaling.parse_args(["--out", str(tmp_path / "s")])
    command = gpu_scaling.study_command(args)
    assert command[0] == "continued-scaling"
    study = continued_scaling.parse(command[1:])
    assert study["data"]["init_args"]["seq_len"] == 8192 and study["budgets"] == [125, 250, 500, 1000]
    assert study["trainer"]["precision"] == "bf16-mixed" and study["eval_device"] == "cuda"
    assert study["arms"] == ["full", "moba:512:3", "moba:512:3:3"] and study["retrieval_lengths"] == [4096, 8192]
    dry = continued_scaling.parse(gpu_scaling.study_command(gpu_scaling.parse_args(
        ["--device", "cpu", "--out", str(tmp_path / "d"), "--seq_len", "256", "--eval_seq_len", "512"]))[1:])
    assert dry["eval_window"] * 16 == 512 and dry["retrieval_lengths"] == []

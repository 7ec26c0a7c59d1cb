"""Model FLOPs utilisation of a short ``flexmoba fit`` from the shipped configs.

Runs ``flexmoba fit --config ... --trainer.*`` in a subprocess (trainer flags only: the model
is the configs' own) into a fresh run folder, then reads the throughput the training layer
logs to ``<root>/csv/version_*/metrics.csv`` (``throughput/train/device/*``: flexmoba's FLOP
counts through Lightning's ``ThroughputMonitor``). MFU is model FLOP/s over the device's dense
peak in the training precision. Lightning logs its own ``mfu`` only for GPU names it knows and
with its own peaks (for the H200 it expects "SXM1"/"NVL1" in the name, and its H200 figures
are the sparse ones, twice the dense peak), so it is shown beside ours, not used.

    python -m benchmarks.gpu_mfu [--configs configs/moba.yaml --steps 100]
    python -m benchmarks.gpu_mfu --device cpu --configs configs/moba.yaml configs/tiny.yaml --steps 4
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import OneLineArgumentParser
from benchmarks.device import describe
from benchmarks.verdict import verdict

REPO = Path(__file__).resolve().parents[1]
KEY = "throughput/train/device/"

# Dense bf16 tensor-core peaks (NVIDIA datasheets, without structured sparsity): name fragment -> FLOP/s.
DENSE_BF16_PEAK = [
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
]


def dense_bf16_peak(device_name: str) -> float | None:
    for fragment, peak in DENSE_BF16_PEAK:
        if fragment.lower() in device_name.lower():
            return peak
    return None


def flexmoba_command() -> list[str]:
    """``flexmoba`` as this checkout defines it (pyproject.toml's console script), run by this
    interpreter: an installed ``flexmoba`` script may belong to another checkout or layout."""
    entry = re.search(r'^flexmoba\s*=\s*"([\w.]+):(\w+)"', (REPO / "pyproject.toml").read_text(), re.M)
    if entry is None:
        raise SystemExit("pyproject.toml declares no flexmoba console script")
    module, function = entry.groups()
    code = f"import sys; sys.argv[0] = 'flexmoba'; from {module} import {function}; sys.exit({function}())"
    return [sys.executable, "-c", code]


def fit_command(configs: list[str], steps: int, device: torch.device, root: Path) -> list[str]:
    args = ["fit"]
    for config in configs:
        args += ["--config", config]
    args += ["--trainer.max_steps", str(steps), "--trainer.accelerator", "gpu" if device.type == "cuda" else "cpu",
             "--trainer.devices", "1", "--trainer.default_root_dir", str(root),
             "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false"]
    if device.type == "cuda":
        args += ["--trainer.precision", "bf16-mixed"]
    return flexmoba_command() + args


def metrics_csv(root: Path) -> Path | None:
    """The newest CSVLogger version's ``metrics.csv`` under ``root/csv``."""
    found = sorted(root.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    return found[-1] if found else None


def last_values(path: Path, prefix: str = KEY) -> dict[str, float]:
    """The last logged value of every column starting with ``prefix``."""
    values = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key and key.startswith(prefix) and value not in (None, ""):
                    values[key[len(prefix):]] = float(value)
    return values


def mfu_summary(values: dict[str, float], device_name: str, device_type: str) -> tuple[str, str]:
    """The verdict on the throughput values of one run (keys without the ``throughput/train/device/`` prefix)."""
    if "flops_per_sec" not in values:
        return "FAIL", f"no {KEY}flops_per_sec in the metrics (logged: {sorted(values) or 'nothing'})"
    flops = values["flops_per_sec"]
    speed = f"{values.get('items_per_sec', float('nan')):.3g} tokens/s, {flops / 1e12:.3g} model TFLOP/s"
    lightning = f"Lightning's mfu {values['mfu']:.2%}" if "mfu" in values else "Lightning logged no mfu"
    if device_type != "cuda":
        return "PASS", f"{speed} on {device_name}; no MFU on a CPU; {lightning}"
    peak = dense_bf16_peak(device_name)
    if peak is None:
        return "FAIL", f"{speed}; no dense bf16 peak known for {device_name!r}; {lightning}"
    return "PASS", f"MFU {flops / peak:.2%} ({speed} / {peak / 1e12:.0f} dense bf16 TFLOP/s); {lightning}"


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", nargs="+", default=["configs/moba.yaml"], help="shipped configs, in order")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--root", type=Path, default=None,
                   help="run folder, kept (default: a fresh temporary one, removed afterwards)")
    p.add_argument("--out", type=Path, default=None, help="folder to copy the run's metrics.csv to")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    device_line = describe(device)
    print(device_line, flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device_line
    root = args.root or Path(tempfile.mkdtemp(prefix="flexmoba-gpu-fit-"))
    try:
        return fit_and_read(args, device, device_name, root)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


def fit_and_read(args, device: torch.device, device_name: str, root: Path) -> int:
    command = fit_command([str(REPO / c) for c in args.configs], args.steps, device, root)
    print("$ " + shlex.join(command), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run(command, cwd=REPO, env=env).returncode
    path = metrics_csv(root)
    if rc != 0:
        return verdict("mfu", "FAIL", f"flexmoba fit exited {rc} (its output is above)")
    if path is None:
        return verdict("mfu", "FAIL", f"flexmoba fit wrote no {root}/csv/version_*/metrics.csv")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.out / "fit_metrics.csv")
    status, why = mfu_summary(last_values(path), device_name, device.type)
    return verdict("mfu", status, f"{' + '.join(args.configs)}, {args.steps} steps: {why}")


if __name__ == "__main__":
    sys.exit(main())

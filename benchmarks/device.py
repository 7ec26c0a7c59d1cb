"""The machine a benchmark runs on, in one line: the GPU, or the CPU model and its threads.

    python -m benchmarks.device [--device cpu]
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.common import OneLineArgumentParser
from benchmarks.verdict import verdict


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``lscpu``, else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def describe(device: torch.device | str) -> str:
    """e.g. ``NVIDIA H200 (sm 9.0, 139.8 GiB), CUDA 12.8, torch 2.13.0`` or
    ``CPU Intel(R) Xeon(R) Processor, 2 cores, 2 torch threads, torch 2.13.0+cpu``."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name} (sm {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB), "
                f"CUDA {torch.version.cuda}, torch {torch.__version__}")
    return (f"CPU {cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}")


def main(argv=None) -> int:
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return verdict("device", "FAIL", f"torch {torch.__version__} sees no CUDA device")
    line = describe(device)
    print(line, flush=True)
    return verdict("device", "PASS", line)


if __name__ == "__main__":
    sys.exit(main())

"""Timing, machine description and report writing shared by the benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """``columns``: (key, header) pairs; floats are printed with 3 significant digits."""
    def cell(value):
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(k, "")) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_report(name: str, rows: list[dict], table: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    path = out_dir / f"{name}.md"
    path.write_text(f"Machine: `{json.dumps(machine())}`\n\n{table}\n")
    return path


def print_row(row: dict, columns: list[tuple[str, str]]) -> None:
    """One table row as soon as it is measured (progress for long runs)."""
    print(markdown_table([row], columns).splitlines()[-1], flush=True)


def finish_report(name: str, rows: list[dict], columns: list[tuple[str, str]], out_dir: Path) -> Path:
    """Write the JSON and Markdown report, print the table and where it went."""
    table = markdown_table(rows, columns)
    path = write_report(name, rows, table, out_dir)
    print(table)
    print(f"written to {path}")
    return path

"""What the benchmarks share: their command line, timing, peak memory, reports, causal and MoBA
block counts, and q/k/v captured from a trained checkpoint.

The benchmarks stand on flexmoba alone (and torch, the standard library): nothing here imports
``lit``, so ``python -m benchmarks.<name>`` runs from a checkout with the core install.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import difflib
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import NoReturn

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexmoba.checkpoint import load_model
from flexmoba.host_memory import MMAP_THRESHOLD, TRIM_THRESHOLD, set_malloc_thresholds
from flexmoba.model import GPT, capture_attention_inputs

BLOCK = 128  # flex block size of the benchmarks

# Reports go to an ignored folder unless --out names the committed one (benchmarks/results).
DEFAULT_OUT = Path("runs/benchmarks")
OUT_HELP = f"report folder (default {DEFAULT_OUT}, not committed; give benchmarks/results to update the committed one)"

# -- the command line --------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """End the benchmark as the ``flexmoba`` command ends on a mistake: ``flexmoba: error: message`` as
    one line (from rank 0 under torchrun) and exit code 2."""
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
        sys.stderr.write(f"flexmoba: error: {' '.join(str(message).split())}\n")
        sys.stderr.flush()
    raise SystemExit(2)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with options spelled out and every error one ``flexmoba: error:`` line (with the option a
    mistyped one may mean), exit code 2. Its program is ``flexmoba bench`` unless given a ``prog``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("prog", "flexmoba bench")
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:
        unknown = re.search(r"unrecognized arguments: (--[\w.]+)", message)
        options = [name for action in self._actions for name in action.option_strings if name not in ("-h", "--help")]
        close = difflib.get_close_matches(unknown[1], options, n=1) if unknown else []
        fail(f"{message}; did you mean {close[0]}?" if close else message)


# -- timing and memory -------------------------------------------------------------------


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    return interleaved_median_seconds([fn], repeats, warmup)[0]


def interleaved_median_seconds(fns: list[Callable[[], object]], repeats: int = 3, warmup: int = 1) -> list[float]:
    """Median wall time of each of ``fns`` over ``repeats`` rounds of one call each, after ``warmup``
    untimed rounds: timed in turns, their ratios see the same machine (separate runs drift apart
    on a noisy VM)."""
    if repeats < 2 or warmup < 1:
        raise ValueError(f"timing needs a warm-up and at least 2 repeats (got warmup={warmup}, repeats={repeats}): "
                         "one cold call is not a measurement")
    for _ in range(warmup):
        for fn in fns:
            fn()
    rounds = [[_timed(fn) for fn in fns] for _ in range(repeats)]
    return [statistics.median(times) for times in zip(*rounds, strict=True)]


def _timed(fn: Callable[[], object]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _proc_status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def settle_malloc() -> None:
    """Fix glibc at the thresholds the ``flexmoba`` launcher sets for CPU runs
    (:func:`flexmoba.host_memory.keep_freed_memory`), so every row is timed under the same
    allocator behaviour as training (call once, on CPU)."""
    set_malloc_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)


@contextlib.contextmanager
def uncached_malloc():
    """Make glibc map every allocation >= 1 MiB afresh and give it back on free, so that
    resident memory follows the tensors alive (else freed memory is reused unseen)."""
    changed = set_malloc_thresholds(1 << 20, 1 << 20)
    if changed:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        yield
    finally:
        if changed:
            settle_malloc()


def peak_extra_mb(fn: Callable[[], object], device) -> float | None:
    """Extra memory at the peak of one ``fn()`` call over what was in use before it; None if unknown.

    CUDA: ``max_memory_allocated``. CPU (Linux): the resident high-water mark VmHWM, reset
    through ``/proc/self/clear_refs``, with glibc told to map and unmap every allocation
    >= 1 MiB during the call so that freed memory is not silently reused.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    try:
        with uncached_malloc():
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            base = _proc_status_kb("VmRSS")
            fn()
            return (_proc_status_kb("VmHWM") - base) / 1024
    except (OSError, AttributeError, ValueError):
        return None


# -- reports -----------------------------------------------------------------------------


def cpu_model() -> str | None:
    """The CPU's name and model number as Linux reports them, e.g. ``Intel(R) Xeon(R) Processor (model 167)``."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        return None
    info = {k.strip(): v.strip() for k, v in info.items()}
    return f"{info.get('model name', '?')} (model {info.get('model', '?')})" if "model name" in info else None


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
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


_HEADERS_SHOWN: set[tuple] = set()


def print_row(row: dict, columns: list[tuple[str, str]]) -> None:
    """One table row as soon as it is measured (progress for long runs), the table's header before the first."""
    lines = markdown_table([row], columns).splitlines()
    if tuple(columns) not in _HEADERS_SHOWN:
        _HEADERS_SHOWN.add(tuple(columns))
        print("\n".join(lines[:2]))
    print(lines[-1], flush=True)


def finish_report(name: str, rows: list[dict], columns: list[tuple[str, str]], out_dir: Path) -> Path:
    """Write the JSON and Markdown report and say where it went (its rows were printed as they came)."""
    path = write_report(name, rows, markdown_table(rows, columns), out_dir)
    info = machine()
    print(f"measured on CPU {info['cpu_model']}, {info['threads']} torch threads, torch {info['torch']}")
    print(f"written to {path} and {path.with_suffix('.json')}")
    return path


def timing_repeats(text: str) -> int:
    """``--repeats``: timed calls per measurement, at least 2 (one warm-up call precedes them)."""
    repeats = int(text)
    if repeats < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2, got {repeats}: the median of one timed call is not a "
                                         "measurement")
    return repeats


# -- masks and attended pairs ------------------------------------------------------------


def causal_mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def causal_block_mask(seq_len: int, device, block: int = BLOCK) -> BlockMask:
    """Causal ``BlockMask`` from int32 tables, no ``S x S`` tensor: diagonal blocks partial, below full."""
    n = -(-seq_len // block)
    rows = torch.arange(n, device=device, dtype=torch.int32)
    kv_num = torch.ones(1, 1, n, device=device, dtype=torch.int32)
    kv_idx = torch.zeros(1, 1, n, n, device=device, dtype=torch.int32)
    kv_idx[..., 0] = rows
    full_num = rows.view(1, 1, n).clone()
    full_idx = rows.view(1, 1, 1, n).expand(1, 1, n, n).contiguous()
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(block, block),
                                    mask_mod=causal_mask_mod, seq_lengths=(seq_len, seq_len))


def block_density(block_mask: BlockMask, seq_len: int) -> float:
    """Fraction of the causal lower triangle's blocks the kernel visits."""
    visited = (block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).float().sum()
    n = -(-seq_len // block_mask.BLOCK_SIZE[0])
    causal_blocks = n * (n + 1) / 2 * block_mask.kv_num_blocks.shape[0] * block_mask.kv_num_blocks.shape[1]
    return float(visited / causal_blocks)


# -- inputs from a trained checkpoint ----------------------------------------------------


def load_checkpoint_model(path: str | Path, device: torch.device) -> GPT:
    """A flexmoba checkpoint's model; on CPU through the gather backend (same math, and no flex
    kernels compiled just to run the model)."""
    return load_model(path, device, **({"moba": {"backend": "gather"}} if device.type == "cpu" else {}))


# The training corpus's defaults (lit.training.data.ByteFilesData): the .py files of this interpreter's
# standard library, these folders skipped, and a tenth of the files (5% val, 5% test by a hash of the path)
# held out of training.
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}
HELD_OUT = 0.05 + 0.05


def corpus_files(root: str) -> list[str]:
    """The ``.py`` files under ``root`` as the training corpus lists them: sorted relative paths, hidden
    folders and :data:`SKIPPED_FOLDERS` left out."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_FOLDERS and not d.startswith("."))
        for name in filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(root).as_posix()
            if path.is_file() and PurePosixPath(relative).match("*.py"):
                files.append(relative)
    return sorted(files)


def held_out(relative_path: str) -> bool:
    """Whether the training corpus keeps this file out of training (its val and test splits)."""
    return int(hashlib.sha1(relative_path.encode()).hexdigest()[:12], 16) / 16**12 < HELD_OUT


def corpus_tokens(seq_len: int) -> torch.Tensor:
    """``[1, S]`` byte tokens of Python source (the training corpus), held-out files first."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(corpus_files(root), key=lambda rel: not held_out(rel))  # stable: path order within each
    paths = [os.path.join(root, rel) for rel in files]
    data = bytearray()
    for p in paths:
        if len(data) >= seq_len:
            break
        data += Path(p).read_bytes()
    if len(data) < seq_len:
        raise ValueError(f"corpus has only {len(data)} bytes, need {seq_len}")
    return torch.tensor(list(data[:seq_len]), dtype=torch.long)[None]


@torch.no_grad()
def capture_qkv(model: GPT, seq_len: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per layer ``(q [1, H, S, D], k [1, H_kv, S, D], v [1, H_kv, S, D])`` of the model on corpus bytes."""
    tokens = corpus_tokens(seq_len).to(device)
    return [tuple(x.contiguous() for x in qkv) for qkv in capture_attention_inputs(model, tokens)]

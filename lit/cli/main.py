"""``flexmoba``: one command, one subcommand per job; ``flexmoba <subcommand> --help`` for each.

    flexmoba fit --config configs/moba.yaml          # train (LightningCLI: fit, validate, test, predict)
    flexmoba compare --seeds 2                       # the main job: MoBA vs full attention
    flexmoba bench attention --seq_lens 8192         # a benchmark from benchmarks/
    flexmoba --version
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from lit.cli.errors import command_scope, fail

LIGHTNING = ("fit", "validate", "test", "predict")
TRAIN_EXTRA = ("lightning", "torchmetrics", "jsonargparse", "yaml", "matplotlib", "tensorboard", "rich")

# subcommand -> (module whose main(argv) runs it, what it does)
SUBCOMMANDS = {
    "fit": ("lit.cli.lightning_cli", "train a model from a config (LightningCLI)"),
    "validate": ("lit.cli.lightning_cli", "validation metrics of a checkpoint"),
    "test": ("lit.cli.lightning_cli", "test-split metrics of a checkpoint"),
    "predict": ("lit.cli.lightning_cli", "per-sequence loss and greedy continuation, written to files"),
    "compare": ("lit.experiments.compare", "main job: MoBA and full attention on one budget, seeds, report"),
    "sweep": ("lit.experiments.sweep", "scaling-law sweep over model sizes (resumable)"),
    "scaling-report": ("lit.experiments.scaling_report", "rebuild a sweep's report: runs.csv, fits, figures"),
    "retrieval": ("lit.experiments.retrieval_evaluate", "needle-retrieval evaluation of a checkpoint"),
    "generate": ("lit.cli.generate", "sample bytes from a checkpoint with MoBA KV-cache decoding"),
    "export-hf": ("lit.cli.export_hf", "write a Hugging Face LlamaForCausalLM folder from a checkpoint"),
    "import-hf": ("lit.cli.import_hf",
                  "a pretrained Llama or Gemma 3 (HF folder, GGUF, smollm2, gemma3-270m) as a flexmoba checkpoint"),
    "context-eval": ("lit.experiments.context_eval", "loss by position and passkey retrieval per attention arm"),
    "continued-scaling": ("lit.experiments.continued_scaling",
                          "continued training of a pretrained model per arm at a ladder of budgets, scored"),
    "continued-scaling-report": ("lit.experiments.continued_scaling_report",
                                 "a continued-scaling study's tables, fits and figures, from its records"),
    "gap-closed": ("lit.experiments.gap_closed", "how much of MoBA's gap continued training closes, per window"),
    "lm-eval": ("lit.experiments.lm_eval_tasks",
                "the RULER retrieval tasks of lm-evaluation-harness on a checkpoint, per arm"),
    "bench": ("benchmarks", "run a benchmark: flexmoba bench {attention,decode,documents,mask_build,...} --help"),
}


def version() -> str:
    """``flexmoba.__version__``, read from its file: ``--version`` and ``--help`` import neither flexmoba
    nor torch (seconds), only a subcommand does."""
    init = Path(importlib.util.find_spec("flexmoba").origin).read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"', init, re.MULTILINE).group(1)


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = [f"  {name:<{width}}  {about}" for name, (_, about) in SUBCOMMANDS.items()]
    return "\n".join([f"usage: flexmoba <subcommand> [options]   (flexmoba {version()})", "",
                      __doc__.split("\n\n")[1].rstrip(), "", "subcommands:", *rows])


def benchmark_names(folder: Path) -> list[str]:
    """What ``flexmoba bench NAME`` runs: the modules of ``folder`` (benchmarks/) that define ``main``."""
    return sorted(path.stem for path in folder.glob("*.py") if "\ndef main(" in path.read_text(encoding="utf-8"))


def run_benchmark(argv: list[str]) -> None:
    """``flexmoba bench NAME ...`` is ``python -m benchmarks.NAME ...`` run from here (this directory, so
    relative paths mean the same) with the checkout on the child's PYTHONPATH; it ends with the benchmark's
    exit code. Nothing of the benchmark is imported into this process."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "benchmarks").is_dir():
        fail("bench: the benchmarks run from a checkout of the repository (benchmarks/ is not installed)")
    names = benchmark_names(checkout / "benchmarks")
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: flexmoba bench NAME [options]   (flexmoba bench NAME --help: its options)\n\n"
              f"benchmarks: {', '.join(names)}")
        return
    if not argv or argv[0].startswith("-"):
        fail(f"bench: name a benchmark: {', '.join(names)}")
    name = argv[0].replace("-", "_")
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        fail(f"bench: no benchmark named {argv[0]!r}; {hint}one of {', '.join(names)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    sys.stdout.flush()
    sys.stderr.flush()
    code = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv[1:]], env=env).returncode
    if code:
        raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv[0] == "--version":
        print(f"flexmoba {version()}")
        return
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; flexmoba --help lists them"
        fail(f"unknown subcommand {name!r}{hint}")
    try:
        with command_scope(["flexmoba", name, *rest]):
            run_subcommand(name, rest)
    except ModuleNotFoundError as error:
        if error.name not in TRAIN_EXTRA:
            raise
        fail(f"{name} needs the training extra ({error.name} is not installed): pip install 'flexmoba[train]'")


def run_subcommand(name: str, rest: list[str], kept_help: bool = True) -> None:
    if kept_help and rest in (["--help"], ["-h"]) and importlib.util.find_spec("lightning") is not None:
        from lit.cli.help_pages import kept_page  # (without Lightning the live path names the extra to install)

        page = kept_page(name)
        if page is not None:
            print(page, end="")
            raise SystemExit(0)  # as argparse's --help ends
    if name in LIGHTNING:
        # argv[0] stays the real program: Lightning's DDP launcher re-runs it in the other ranks.
        sys.argv = [sys.argv[0], name, *rest]
        importlib.import_module("lit.cli.lightning_cli").main()
        return
    sys.argv = [f"flexmoba {name}", *rest]  # argparse names the program after argv[0]
    if name == "bench":
        run_benchmark(rest)
        return
    importlib.import_module(SUBCOMMANDS[name][0]).main(rest)


if __name__ == "__main__":
    main()

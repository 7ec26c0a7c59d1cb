"""Run many ``flexmoba`` command lines fast: import the command once, then run each in a forked process.

    python tests/lit/cli/forked_commands.py < commands.json > results.json

``commands.json`` is a list of ``{"argv": [...], "cwd": "..."}``; each result is ``{"rc", "stdout",
"stderr"}`` of that command run by :func:`lit.cli.main.main` in its own child process, which ends
the way the interpreter would: ``SystemExit``'s code, or a printed traceback and exit code 1. The
children share nothing but the imports (torch, Lightning: seconds each time otherwise).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HEAVY_IMPORTS = ("lit.training.launch", "lit.experiments.compare", "lit.experiments.sweep",
                 "lit.experiments.retrieval", "lit.experiments.scaling_report", "lit.cli.generate",
                 "lit.cli.export_hf", "lit.cli.lightning_cli", "transformers")


def exit_code(exit: SystemExit) -> int:
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def run_in_child(argv: list[str], cwd: str, out_path: str, err_path: str) -> None:
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    from lit.cli.main import main

    try:
        main(argv)
        code = 0
    except SystemExit as exit:
        code = exit_code(exit)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], cwd: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out_path, err_path = os.path.join(folder, "out"), os.path.join(folder, "err")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_in_child(argv, cwd, out_path, err_path)
        _, status = os.waitpid(pid, 0)
        return {"rc": os.waitstatus_to_exitcode(status), "stdout": Path(out_path).read_text(),
                "stderr": Path(err_path).read_text()}


def main() -> None:
    import importlib

    for name in HEAVY_IMPORTS:
        importlib.import_module(name)
    commands = json.load(sys.stdin)
    json.dump([run(command["argv"], command["cwd"]) for command in commands], sys.stdout)


if __name__ == "__main__":
    main()

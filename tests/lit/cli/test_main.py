"""The one ``flexmoba`` command: its subcommands, --help on each, --version, clear errors."""

import subprocess
import sys

import pytest

import flexmoba
from lit.cli import help_pages
from lit.cli.main import LIGHTNING, SUBCOMMANDS, main


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    assert run(capsys, "--version") == (0, f"flexmoba {flexmoba.__version__}\n", "")


def test_version_and_help_import_no_torch():
    """``flexmoba --version`` and ``--help`` answer in a fraction of a second: torch (seconds) is not imported."""
    code = ("import sys; from lit.cli.main import main; main(['--version']); main(['--help']); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, *_, torch_imported = proc.stdout.splitlines()
    assert (version, torch_imported) == (f"flexmoba {flexmoba.__version__}", "False"), proc.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_of_a_subcommand_imports_no_torch(name):
    """``flexmoba <subcommand> --help`` in a fresh interpreter, then whether torch or Lightning (seconds to
    import) were imported to build it."""
    argv = [name, "--help"]
    code = (f"import sys\nfrom lit.cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit as exit:\n"
            "    assert not exit.code, exit.code\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'transformers'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]", f"flexmoba {name} --help imported {proc.stdout.splitlines()[-1]}"


@pytest.mark.parametrize("name", help_pages.KEPT)
def test_a_kept_help_page_is_the_one_lightning_cli_builds(name):
    """The pages LightningCLI builds (seconds: Lightning and torch) are kept as text; built afresh, each is
    the kept one (else: python -m lit.cli.help_pages)."""
    assert help_pages.kept_page(name) == help_pages.built_page(name), f"{name}: run python -m lit.cli.help_pages"


def test_help_with_other_arguments_is_built_live(capfd):
    code, out, _ = run(capfd, "fit", "--trainer.max_steps", "3", "--help")
    assert code == 0 and "--trainer.max_steps" in out and out != help_pages.kept_page("fit")


def test_bare_command_lists_every_subcommand(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    assert all(f"  {name} " in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capfd):
    """(Read from the file descriptors: ``flexmoba bench NAME`` runs the benchmark in a child process.)"""
    argv = ["bench", "attention", "--help"] if name == "bench" else [name, "--help"]
    code, out, err = run(capfd, *argv)
    assert code == 0, err
    if name in LIGHTNING:  # LightningCLI names the program after the real argv[0]
        assert out.startswith("usage: ") and f"[options] {name}" in out and "--trainer" in out, out[:300]
    else:
        assert out.startswith(f"usage: flexmoba {name}"), out[:200]


def test_bench_help_lists_the_benchmarks(capsys):
    code, out, err = run(capsys, "bench", "--help")
    assert code == 0 and out.startswith("usage: flexmoba bench NAME") and "attention, context_parallel" in out, err


@pytest.mark.parametrize("argv, message", [
    (["comprae"], "unknown subcommand 'comprae'; did you mean compare?"),
    (["bench"], "name a benchmark"),
    (["bench", "no_such"], "no benchmark named 'no_such'"),
    (["scaling-report", "--sweep_dir", "/no/such/folder"], "no finished runs"),
])
def test_errors_are_one_line_with_exit_2(argv, message, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err


WITHOUT_TRAINING_STACK = """
import sys

class Blocker:  # as if only `pip install flexmoba` (torch) were installed
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ("lightning", "torchmetrics", "jsonargparse", "matplotlib", "tensorboard", "yaml", "rich"):
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)

sys.meta_path.insert(0, Blocker())
from lit.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("argv, code, stream, text", [
    (["--version"], 0, "stdout", f"flexmoba {flexmoba.__version__}"),
    (["compare", "--help"], 2, "stderr", "flexmoba: error: compare needs the training extra"),
    (["fit", "--config", "x.yaml"], 2, "stderr", "pip install 'flexmoba[train]'"),
])
def test_without_the_training_extra_the_command_says_what_to_install(argv, code, stream, text):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TRAINING_STACK, *argv], capture_output=True, text=True,
                          timeout=120)
    output = getattr(proc, stream)
    assert proc.returncode == code and text in output, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") <= 1

"""How the ``flexmoba`` command ends on an error: one line on stderr, from one process.

A user mistake (a bad value, a path that is not there, a file that is not a checkpoint, a device this
machine lacks, output that would be overwritten) is ``flexmoba: error: --option: what is wrong; what
to do`` and exit code 2. Code below the command raises :class:`~lit.training.errors.UsageError` or,
from the launcher's parser, :class:`~lit.training.errors.ConfigError` (jsonargparse's message, worded
here as ``--option: rule``); the command's entry (:func:`one_line_errors`) turns either into that
line. A diverged run is one line and exit code 1. Ctrl-C is one line naming the step reached and the
command that resumes the run, exit code 130.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
from typing import NoReturn

from lit.cli.console import quiet_console
from lit.training.errors import ConfigError, RunInterrupted, TrainingDiverged, UsageError, is_rank_zero
from lit.training.interrupts import interrupt_requests
from lit.training.options import with_suggestion
from lit.training.process_group import process_group_destroyed_at_end

PARSER_KEY = re.compile(r'^\s*(?:- )?Parser key "([^"]+)":\s*(.*)$')
EXPECTED_TYPE = re.compile(r"^Expected a <class '(\w+)'>\. Got value: (.*)$")
UNION_NOISE = ("Does not validate against", "Subtypes:", "Errors:", "- Problem with given class_path",
               "- Expected a <class 'NoneType'>", "Given value")
# The launcher's "--model.config: ModelConfig.d_model=30 must be ..." (or "MobaSpec.top_k must be ..."):
# the field ModelConfig names, then its rule.
MODEL_FIELD = re.compile(r"--model\.config: (ModelConfig|MobaSpec)\.(\w+)( |=)(.*)", re.DOTALL)


def fail(message: str) -> NoReturn:
    """End the command: ``flexmoba: error: message`` as one line (from rank 0) and exit code 2."""
    if is_rank_zero():
        sys.stderr.write(f"flexmoba: error: {' '.join(str(message).split())}\n")
        sys.stderr.flush()
    raise SystemExit(2)


def one_line_error(message: str) -> str:
    """jsonargparse's nested, multi-line message as ``--option: rule``.

    The option is the path of the innermost ``Parser key`` (``init_args`` dropped); the rule
    is the first line under it that is not about the ``X | None`` union around it.
    """
    keys, rule = [], None
    for line in message.splitlines():
        match = PARSER_KEY.match(line)
        if match:
            keys += [k for k in match.group(1).split(".") if k != "init_args"]
            rule = match.group(2) or None
        elif keys and rule is None and line.strip() and not line.strip().startswith(UNION_NOISE):
            rule = line.strip()
    if not keys:
        return " ".join(line.strip() for line in message.splitlines() if line.strip())
    expected = EXPECTED_TYPE.match(rule or "")
    if expected:
        rule = f"must be {expected.group(1)}, got {expected.group(2)!r}"
    return f"--{'.'.join(keys)}: {rule}"


def model_field_line(line: str) -> str:
    """``--model.config: ModelConfig.d_model=30 must be ...`` as ``--model.config.d_model: d_model=30 must
    be ...`` (``MobaSpec.top_k ...`` as ``--model.config.moba.top_k: ...``); any other line as it is."""
    field = MODEL_FIELD.fullmatch(line)
    if not field:
        return line
    kind, name, separator, rule = field.groups()
    option = ("--model.config." if kind == "ModelConfig" else "--model.config.moba.") + name
    return f"{option}: {rule if separator == ' ' else name + '=' + rule}"


def config_line(error: ConfigError) -> str:
    """The launcher's refusal as one line naming the option, with the option a mistyped one may mean."""
    return with_suggestion(model_field_line(one_line_error(error.message)), error.options)


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a program Ctrl-C stopped


def without_option(args: list[str], option: str) -> list[str]:
    """``args`` without ``option VALUE`` and ``option=VALUE``."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


def interrupted_line(error: RunInterrupted | None, command: list[str]) -> str:
    """``interrupted at step 37 (resumes from step 36); resume with: flexmoba fit ... --ckpt_path last``.

    ``command`` is the command as run (``["flexmoba", "fit", ...]``); a fit resumes with ``--ckpt_path last``
    in place of any ``--ckpt_path`` it had, compare and sweep with the same command (they resume their runs).
    """
    if error is None:
        return f"interrupted; run it again with: {shlex.join(command)}"
    at = f"interrupted at step {error.step}" if error.step is not None else "interrupted"
    where = f" of {error.run_dir}" if error.run_dir and command[1:2] != ["fit"] else ""
    if not error.resumable:
        return f"{at}{where}, before its first checkpoint; start again with: {shlex.join(command)}"
    if command[1:2] == ["fit"]:
        command = [*without_option(command, "--ckpt_path"), "--ckpt_path", "last"]
    newest = f"step {error.saved_step}" if error.saved_step is not None else "its newest checkpoint"
    return f"{at}{where} (resumes from {newest}); resume with: {shlex.join(command)}"


@contextlib.contextmanager
def one_line_errors(command: list[str] | None = None):
    """A :class:`UsageError` or :class:`ConfigError` ends the command with exit code 2, a diverged run with
    exit code 1, each as one ``flexmoba: error: ...`` line (every process stops; rank 0 says why); Ctrl-C
    with one ``flexmoba: interrupted ...`` line saying how to resume ``command`` (default: ``flexmoba`` and
    this process's arguments), exit code 130."""
    try:
        yield
    except UsageError as error:
        fail(str(error))
    except ConfigError as error:
        fail(config_line(error))
    except TrainingDiverged as diverged:
        if is_rank_zero():
            sys.stderr.write(f"flexmoba: error: {diverged}\n")
        raise SystemExit(1) from None
    except (RunInterrupted, KeyboardInterrupt) as stop:
        said = stop if isinstance(stop, RunInterrupted) else None
        if is_rank_zero():
            sys.stderr.write(f"flexmoba: {interrupted_line(said, command or ['flexmoba', *sys.argv[1:]])}\n")
            sys.stderr.flush()
        raise SystemExit(INTERRUPTED) from None


@contextlib.contextmanager
def command_scope(command: list[str]):
    """What every ``flexmoba`` subcommand runs inside: the quiet console, the one-line ending
    (:func:`one_line_errors`), Ctrl-C that is never lost (:func:`lit.training.interrupts.interrupt_requests`)
    and the end of any process group it made (:func:`lit.training.process_group.process_group_destroyed_at_end`)."""
    with quiet_console(), one_line_errors(command), process_group_destroyed_at_end(), interrupt_requests():
        yield

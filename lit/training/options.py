"""Argument parsing of the jobs that are not LightningCLI (the experiments, the command's own tools).

Every option is a field of one dataclass, parsed by jsonargparse (``--name value``, nested
dataclasses as ``--model.field value``, ``--config job.yaml``, ``--print_config``), or an option
of a :class:`OneLineArgumentParser` (the sweep). A bad value raises :class:`BadArguments`, one line
naming the option, which the ``flexmoba`` command prints with exit code 2 (:mod:`lit.cli.errors`);
options are spelled out (no abbreviations).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from dataclasses import MISSING, fields, is_dataclass
from typing import TypeVar, get_type_hints

from lit.training.errors import BadArguments, UsageError

T = TypeVar("T")


PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
GIVEN_VALUE = re.compile(r"(?:Given value|Got value): (.*)$", re.MULTILINE)
EXPECTED_LITERAL = re.compile(r"Expected a typing\.Literal\[(.*?)\]")
EXPECTED_CLASS = re.compile(r"Expected a <class '(\w+)'>")


def value_rule(message: str) -> str | None:
    """jsonargparse's refusal of a value as ``--option: must be one of moba, full, or null, got 'sparse'``
    (the choices of a Literal, the type of a plain option, ``null`` where the option may be None), or None
    when ``message`` is not a refused value."""
    keys = [k for key in PARSER_KEY.findall(message) for k in key.split(".") if k != "init_args"]
    given = GIVEN_VALUE.search(message)
    if not keys or not given:
        return None
    literal = EXPECTED_LITERAL.search(message)
    kinds = [kind for kind in dict.fromkeys(EXPECTED_CLASS.findall(message)) if kind != "NoneType"]
    if literal:
        try:
            choices = ast.literal_eval(f"[{literal.group(1)}]")
        except (ValueError, SyntaxError):
            return None
        rule = "must be one of " + ", ".join(str(choice) for choice in choices)
    elif kinds:
        rule = "must be " + " or ".join(kinds)
    else:
        return None
    if "<class 'NoneType'>" in message:
        rule += ", or null"
    return f"--{'.'.join(keys)}: {rule}, got {given.group(1).strip()!r}"


def one_line(error: Exception) -> str:
    """jsonargparse's refusal as one line: a refused value as :func:`value_rule` words it, else its first two
    lines (``Parser key "steps":`` and why) as ``--steps: why``; a --config file that is not a mapping of the
    options named as ``--config``."""
    message = str(error)
    rule = value_rule(message)
    if rule:
        return rule
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    key = re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', lines[0]) if lines else None
    if key:
        return f"--{key[1]}: {key[2] or (lines[1] if len(lines) > 1 else 'refused')}"
    if lines and lines[0].startswith("Unexpected config"):
        return f"--config: not a YAML mapping of this command's options ({lines[0]})"
    return " ".join(lines[:2])


def dataclass_parser(cls: type, *, prog: str, description: str = ""):
    """The jsonargparse parser of ``cls``'s fields (one option each) and ``--config``, as :func:`parse_dataclass`
    parses with it."""
    from jsonargparse import ArgumentParser  # the train extra; flexmoba --version works without it

    parser = ArgumentParser(prog=prog, description=description, exit_on_error=False, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="config", help="a YAML file of these options")
    parser.add_class_arguments(cls, None, as_group=False)
    return parser


def nested_dataclass(cls: type, name: str) -> type | None:
    """The dataclass that field ``name`` of dataclass ``cls`` holds, if any."""
    hint = get_type_hints(cls).get(name)
    return hint if is_dataclass(hint) else None


def option_names(cls, prefix: str = "--") -> list[str]:
    names = []
    for f in fields(cls):
        names.append(prefix + f.name)
        if nested_dataclass(cls, f.name):
            names += option_names(nested_dataclass(cls, f.name), f"{prefix}{f.name}.")
    return names


def with_suggestion(message: str, options: list[str]) -> str:
    """``message`` plus the nearest valid option for a mistyped one (an unrecognised argument,
    or a key jsonargparse did not accept inside a group)."""
    nested = re.match(r"(--[\w.]+): unrecognized arguments: --([\w.]+)", message)  # inside a nested config
    unknown = re.search(r"unrecognized arguments: (--[\w.]+)", message)
    rejected = re.match(r"(--[\w.]+): Option '(\w+)' is not accepted", message)
    typo = (f"{nested[1]}.{nested[2]}" if nested else unknown[1] if unknown
            else f"{rejected[1]}.{rejected[2]}" if rejected else None)
    close = nearest_option(typo, options) if typo else None
    return f"{message}; did you mean {close}?" if close else message


def nearest_option(typo: str, options: list[str]) -> str | None:
    """The option ``typo`` most likely means: the closest whole name, else the closest last part
    (``--step`` -> ``--trainer.max_steps``)."""
    options = [name for name in options if name not in ("--help", "-h")]
    close = difflib.get_close_matches(typo, options, n=1)
    if close:
        return close[0]
    last_parts = {name.rsplit(".", 1)[-1].lstrip("-"): name for name in options}
    close = difflib.get_close_matches(typo.rsplit(".", 1)[-1].lstrip("-"), last_parts, n=1)
    return last_parts[close[0]] if close else None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with options spelled out; every error is one :class:`BadArguments` line (``--help`` still exits 0)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str):
        options = [name for action in self._actions for name in action.option_strings]
        raise BadArguments(with_suggestion(message, options))


def bare_value_hint(message: str, cls: type, argv: list[str]) -> str | None:
    """For a value given without its option name (``unrecognized arguments: runs/x``) while a required
    option of ``cls`` is missing from ``argv``: the line naming that option."""
    bare = re.search(r"unrecognized arguments: ([^-\s]\S*)", message)
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f"--{f.name}" not in argv and not any(arg.startswith(f"--{f.name}=") for arg in argv)]
    if not (bare and missing):
        return None
    return f"--{missing[0]}: {bare[1]} is given without an option name; give --{missing[0]} {bare[1]}"


def to_dataclass(cls: type[T], namespace) -> T:
    values = {f.name: namespace.as_dict()[f.name] for f in fields(cls)}
    for f in fields(cls):
        nested = nested_dataclass(cls, f.name)
        if nested and isinstance(values[f.name], dict):
            values[f.name] = nested(**values[f.name])
    return cls(**values)


def parse_dataclass(cls: type[T], argv: list[str] | None, *, prog: str, description: str = "") -> T:
    """Parse ``argv`` into a ``cls`` instance; any error is one :class:`BadArguments` line."""
    parser = dataclass_parser(cls, prog=prog, description=description)
    argv = sys.argv[1:] if argv is None else argv
    try:
        namespace = parser.parse_args(argv)
    except argparse.ArgumentError as error:
        message = bare_value_hint(one_line(error), cls, argv) or with_suggestion(one_line(error), option_names(cls))
        raise BadArguments(message) from None
    try:
        return to_dataclass(cls, namespace)
    except UsageError:
        raise
    except (TypeError, ValueError) as error:
        raise BadArguments(one_line(error)) from None

"""Command-line parsing shared by the ``flexmoba`` subcommands that are not LightningCLI.

Every option is a field of one dataclass, parsed by jsonargparse (``--name value``, nested
dataclasses as ``--model.field value``, ``--config job.yaml``, ``--print_config``). A bad value
is one line on stderr naming the option, and exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import fields, is_dataclass
from typing import TypeVar, get_type_hints

T = TypeVar("T")


def resolve_device(device: str) -> str:
    """``"auto"``: CUDA when there is a GPU, else CPU; anything else as given."""
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def fail(prog: str, message: str) -> None:
    """Print ``prog: error: message`` as one line and exit with code 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def one_line(error: Exception) -> str:
    """jsonargparse's first two lines (``Parser key "steps":`` and why) as one."""
    return " ".join(line.strip() for line in str(error).splitlines()[:2])


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
    close = difflib.get_close_matches(typo, options, n=1) if typo else []
    return f"{message}; did you mean {close[0]}?" if close else message


def to_dataclass(cls: type[T], namespace) -> T:
    values = {f.name: namespace.as_dict()[f.name] for f in fields(cls)}
    for f in fields(cls):
        nested = nested_dataclass(cls, f.name)
        if nested and isinstance(values[f.name], dict):
            values[f.name] = nested(**values[f.name])
    return cls(**values)


def parse_dataclass(cls: type[T], argv: list[str] | None, *, prog: str, description: str = "") -> T:
    """Parse ``argv`` into a ``cls`` instance; any error exits 2 with one line."""
    from jsonargparse import ArgumentParser  # the train extra; flexmoba --version works without it

    parser = ArgumentParser(prog=prog, description=description.replace("%", "%%"), exit_on_error=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="config", help="a YAML file of these options")
    parser.add_class_arguments(cls, None, as_group=False)
    try:
        namespace = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except argparse.ArgumentError as error:
        fail(prog, with_suggestion(one_line(error), option_names(cls)))
    try:
        return to_dataclass(cls, namespace)
    except (TypeError, ValueError) as error:
        fail(prog, one_line(error))

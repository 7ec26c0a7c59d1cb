"""Every benchmark's ``--help`` names the folder its report goes to by default."""

import argparse
import importlib
from pathlib import Path
from unittest import mock

import pytest

from lit.cli.main import benchmark_names

REPO = Path(__file__).resolve().parents[2]


class Parsed(Exception):
    """Raised in place of parsing: the benchmark's parser, caught before it runs anything."""


def parser_of(name: str) -> argparse.ArgumentParser:
    def capture(self, *args, **kwargs):
        raise Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), pytest.raises(Parsed) as parsed:
        importlib.import_module(f"benchmarks.{name}").main([])
    return parsed.value.args[0]


@pytest.mark.parametrize("name", benchmark_names(REPO / "benchmarks"))
def test_the_help_names_the_folder_the_report_goes_to(name):
    parser = parser_of(name)
    out = parser._option_string_actions.get("--out")
    if out is None or out.default is None:
        return
    page = parser.format_help()
    said = " ".join(page[page.index("\n  --out OUT") + 1:].split("\n  -")[0].split())
    assert str(out.default) in said, f"bench {name} --help says {said!r}, writes to {out.default}"

"""What README.md and docs/ point to is there: every relative link resolves to a file of the repository
(its ``#anchor`` to a heading of that file), and every repository path they name in backticks
(``flexmoba/...``, ``lit/...``, ``tests/...``, ``benchmarks/...``, ``configs/...``, ``docs/...``,
``examples/...``) exists. The changelog and docs/performance_history.md are history and name what was."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HISTORY = {REPO / "CHANGELOG.md", REPO / "docs" / "performance_history.md"}
PAGES = [p for p in [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "tests" / "README.md",
                     *sorted((REPO / "docs").glob("**/*.md"))] if p not in HISTORY]
WRITTEN_WHEN_RUN = {"benchmarks/results/gpu.md"}  # benchmarks/gpu.sh's report: there once a GPU has run it
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NAMED_PATH = re.compile(r"`((?:flexmoba|lit|tests|benchmarks|configs|docs|examples)/[\w./-]*?)(?:::[\w\[\]*.-]+)?`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```|~~~.*?~~~", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


def missing_paths(page: Path) -> list[str]:
    """Named paths that are neither in the repository nor beside the page (tests/README.md names test files
    from tests/)."""
    named = {m for m in NAMED_PATH.findall(page.read_text(encoding="utf-8")) if not re.search(r"[<>*{]", m)}
    return sorted(name for name in named - WRITTEN_WHEN_RUN
                  if not any((root / name.rstrip("/")).exists() for root in (REPO, page.parent)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_repository_path_named_exists(page):
    assert missing_paths(page) == []


def test_the_checks_find_a_broken_link_an_anchor_and_a_path(tmp_path):
    (tmp_path / "other.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [anchor](other.md#a-heading-with-code) [bad](gone.md) "
                    "[bad anchor](other.md#nope) [web](https://example.org) `flexmoba/no_such_module.py` "
                    "`flexmoba/spec.py` `tests/test_design_tree.py::test_the_design_tree_is_the_package_tree`\n")
    assert broken_links(page) == ["gone.md (no such file)", "other.md#nope (no heading #nope)"]
    assert missing_paths(page) == ["flexmoba/no_such_module.py"]


def test_the_readme_is_a_door():
    """At most 250 lines, the two commands of a fresh machine first, every subcommand in its table."""
    import ast

    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250, "README.md: move the detail to docs/"
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)[1]
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make compare", "make test"]
    tree = ast.parse((REPO / "lit" / "cli" / "main.py").read_text(encoding="utf-8"))
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "SUBCOMMANDS" for t in node.targets))
    subcommands = {key.value for key in table.keys}
    start = text.index("## The `flexmoba` command")
    section = text[start:text.index("\n## ", start + 1)]
    listed = {name.split()[0] for row in re.findall(r"^\| (`[^|]+`) \|", section, re.M)
              for name in re.findall(r"`([^`]+)`", row)}
    assert listed == subcommands, (sorted(subcommands - listed), sorted(listed - subcommands))

"""The tree of ``flexmoba/`` in docs/design.md is the package's tree: every file and folder under
``flexmoba/`` is in it, at its place, and it names nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"


def documented_tree(text: str) -> list[str]:
    """The paths of the ``text`` block that starts with ``flexmoba/``, from its two-space indentation."""
    block = re.search(r"```text\n(flexmoba/\n.*?)```", text, re.S)
    assert block, "docs/design.md has no ```text block starting with flexmoba/"
    paths, parents = [], []
    for line in block[1].splitlines():
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        assert depth <= len(parents), f"{line!r} is indented deeper than its folder"
        parents = parents[:depth]
        paths.append("/".join([*parents, name]).replace("//", "/"))
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
    return paths


def package_tree(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        relative = path.relative_to(root.parent).as_posix()
        found.append(relative + "/" if path.is_dir() else relative)
    return [root.name + "/", *found]


def test_the_design_tree_is_the_package_tree():
    documented = documented_tree(DESIGN.read_text(encoding="utf-8"))
    assert len(documented) == len(set(documented)), "a path is listed twice"
    actual = package_tree(REPO / "flexmoba")
    assert sorted(documented) == sorted(actual), (
        f"in docs/design.md, not in flexmoba/: {sorted(set(documented) - set(actual))}; "
        f"in flexmoba/, not in docs/design.md: {sorted(set(actual) - set(documented))}")


def test_the_reader_places_each_name_under_its_folder():
    text = "```text\nflexmoba/\n  a.py   x\n  sub/   y\n    b.py  z\n  c.py  w\n```\n"
    assert documented_tree(text) == ["flexmoba/", "flexmoba/a.py", "flexmoba/sub/", "flexmoba/sub/b.py",
                                     "flexmoba/c.py"]

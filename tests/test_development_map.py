"""The map of the package in docs/development.md ("Map of the package") matches the package.

The map is the fenced block after ``<!-- package-map -->``: one line per path under
``snapkv_rag/``, ``path — what it does``. A folder's line (``rag/``) stands for its
``__init__.py``. Every module file must be named there, and every path named must exist, so a
module added, moved or deleted without updating the map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "snapkv_rag"
PAGE = ROOT / "docs" / "development.md"
MAP = re.compile(r"<!-- package-map -->\n```text\n(?P<body>.*?)```", re.S)
LINE = re.compile(r"^(?P<path>\S+) — (?P<what>\S.*)$")


def map_entries(text: str) -> dict[str, str]:
    """``path -> description`` for every line of the map in ``text``."""
    found = MAP.search(text)
    assert found, "docs/development.md has no package map (a ```text block after <!-- package-map -->)"
    entries: dict[str, str] = {}
    for line in found.group("body").splitlines():
        if not line.strip():
            continue
        m = LINE.match(line)
        assert m, f"not a map line (path — what it does): {line!r}"
        assert m.group("path") not in entries, f"named twice in the map: {m.group('path')}"
        entries[m.group("path")] = m.group("what")
    return entries


def module_names(package: Path = PACKAGE) -> set[str]:
    """How the map names each module file: ``sub/module.py``, or ``sub/`` for ``sub/__init__.py``."""
    names = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        if rel.name == "__init__.py" and rel.parent != Path("."):
            names.add(rel.parent.as_posix() + "/")
        else:
            names.add(rel.as_posix())
    return names


def mismatches(entries: dict[str, str], package: Path = PACKAGE) -> tuple[list[str], list[str]]:
    """(modules the map leaves out, paths the map names that do not exist)."""
    missing = sorted(module_names(package) - set(entries))
    absent = sorted(p for p in entries if not (package / p).exists() or p.endswith("/") != (package / p).is_dir())
    return missing, absent


def test_the_map_names_every_module_and_only_paths_that_exist():
    missing, absent = mismatches(map_entries(PAGE.read_text()))
    assert missing == [], f"modules missing from the map in docs/development.md: {missing}"
    assert absent == [], f"paths in the map of docs/development.md that do not exist: {absent}"


def test_the_check_catches_a_module_left_out_and_a_path_gone(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (tmp_path / name).write_text("")
    page = "<!-- package-map -->\n```text\n__init__.py — x\na.py — x\nsub/ — x\nsub/b.py — x\n```\n"
    assert mismatches(map_entries(page), tmp_path) == ([], [])
    (tmp_path / "sub" / "c.py").write_text("")
    (tmp_path / "a.py").unlink()
    assert mismatches(map_entries(page), tmp_path) == (["sub/c.py"], ["a.py"])

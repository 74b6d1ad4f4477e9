"""The package's layering (docs/development.md, "Layers"): no import circle between any two
modules, and no subpackage importing one above it or beside it. Imports are read from the
source, every kind counted: at module level, inside functions (run time) and under
``TYPE_CHECKING``.

Around the package: the connectors, their examples, apps/ and the packaged app import only the
public surface (``snapkv_rag``, ``snapkv_rag.errors``, ``snapkv_rag.integrations``, pinned here)
and no private name; the package never imports the benchmarks (eval/), which may import the
package (their own rules: tests/test_eval_suite.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "snapkv_rag"

# Lowest first. A module may import its own subpackage and the layers below it, nothing else.
LAYERS: list[set[str]] = [
    {"errors", "_version", "lookalike_world"},
    {"model"},
    {"compression"},
    {"reuse"},
    {"tools"},
    {"engine"},
    {"less_training"},
    {"agents"},
    {"rag"},
    {"adapter_training"},
    {"harness"},
    {"server"},
    # entry points: the public facades, the command lines (each subpackage's cli module too) and the app
    {"__init__", "integrations", "testing", "cli", "cli_common", "app", "*.cli"},
]
ROOT_MODULE_LIMIT = 8


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name (without the package's) -> file, ``""`` for the package itself."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import of the package's own modules in ``path``."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if name else []
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "snapkv_rag" or node.module.startswith("snapkv_rag.")):
                target = node.module.removeprefix("snapkv_rag").lstrip(".")
            else:
                continue
            submodules = [f"{target}.{a.name}".lstrip(".") for a in node.names if f"{target}.{a.name}".lstrip(".") in known]
            found += [(m, node.lineno) for m in submodules]
            if len(submodules) < len(node.names):  # names defined in the module itself
                found.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "snapkv_rag" or alias.name.startswith("snapkv_rag."):
                    found.append((alias.name.removeprefix("snapkv_rag").lstrip("."), node.lineno))
    return [(m, line) for m, line in found if m in known and m != name]


def graph(root: Path = PACKAGE) -> dict[str, list[tuple[str, int]]]:
    mods = modules(root)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> str:
    """What a module's layer is decided by: its subpackage, its own name at the root, ``*.cli`` for a subpackage's command line."""
    if module == "":
        return "__init__"
    parts = module.split(".")
    if len(parts) > 1 and parts[-1] == "cli":
        return "*.cli"
    return parts[0]


def layer(module: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit(module) in units:
            return i
    raise AssertionError(f"snapkv_rag.{module} belongs to no layer: add its subpackage to LAYERS and to docs/development.md")


def violations(edges: dict[str, list[tuple[str, int]]]) -> list[str]:
    out = []
    for a, targets in sorted(edges.items()):
        for b, line in targets:
            same_unit = unit(a) == unit(b) or (a.split(".")[0] == b.split(".")[0] and unit(b) != "*.cli")
            if same_unit or layer(b) < layer(a) or layer(a) == len(LAYERS) - 1:
                continue
            out.append(f"snapkv_rag.{a} (layer {layer(a)}) imports snapkv_rag.{b} (layer {layer(b)}) at line {line}")
    return out


def test_no_import_circle_between_any_two_modules():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(f"snapkv_rag.{m}" or "snapkv_rag" for m in c) for c in found)


def test_each_subpackage_imports_only_the_layers_below_it():
    assert violations(graph()) == []


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_the_checks_catch_a_broken_import():
    edges = graph()
    broken = {k: list(v) for k, v in edges.items()}
    broken["compression.base"].append(("engine.engine", 1))
    assert any("compression.base (layer 2) imports snapkv_rag.engine.engine" in v for v in violations(broken))
    assert any({"compression.base", "engine.engine"} <= set(c) for c in cycles(broken))
    sideways = {k: list(v) for k, v in edges.items()}
    sideways["reuse.blending"].append(("tools.calls", 1))
    assert "snapkv_rag.reuse.blending (layer 3) imports snapkv_rag.tools.calls (layer 4) at line 1" in violations(sideways)
    into_cli = {k: list(v) for k, v in edges.items()}
    into_cli["rag.qa"].append(("rag.cli", 1))
    assert f"snapkv_rag.rag.qa (layer 8) imports snapkv_rag.rag.cli (layer {len(LAYERS) - 1}) at line 1" in violations(into_cli)


def test_reading_imports_counts_function_level_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n    from . import a\n")
    (pkg / "sub" / "c.py").write_text("from ..b import f\n")
    edges = graph(pkg)
    assert sorted(edges["a"]) == [("b", 3)]
    assert sorted(edges["b"]) == [("a", 3), ("sub.c", 2)]
    assert cycles(edges) == [["a", "b", "sub.c"]]


def test_the_root_holds_few_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert len(root) <= ROOT_MODULE_LIMIT, root


# ----------------------------------------------------------------------------- around the package
REPO = PACKAGE.parent
# What code outside the package (connectors, their examples, apps) and the packaged app import.
PUBLIC_SURFACE = {"snapkv_rag", "snapkv_rag.errors", "snapkv_rag.integrations"}


def absolute_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` for every absolute import of ``snapkv_rag`` or ``eval`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
    return [(m, names, line) for m, names, line in found if m.split(".")[0] in ("snapkv_rag", "eval")]


def outside_code() -> list[Path]:
    """The connectors' packages and examples (not their tests) and apps/."""
    paths = [p for p in (REPO / "connectors").rglob("*.py") if "tests" not in p.relative_to(REPO).parts]
    return paths + list((REPO / "apps").rglob("*.py"))


def surface_violations(paths: list[Path], allowed: set[str]) -> list[str]:
    out = []
    for path in paths:
        for module, names, line in absolute_imports(path):
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{line}"
            if module not in allowed:
                out.append(f"{where} imports {module}")
            out += [f"{where} imports the private name {module}.{n}" for n in names if n.startswith("_")]
    return out


def test_connectors_and_apps_import_only_the_public_surface():
    paths = outside_code()
    assert len(paths) > 15
    assert surface_violations(paths, PUBLIC_SURFACE) == []


def test_the_packaged_app_imports_only_the_public_surface():
    app = [p for p in (PACKAGE / "app").glob("*.py")]
    # besides the surface: its own modules, and the options every command shares (it is a command too)
    assert surface_violations(app, PUBLIC_SURFACE | {"snapkv_rag.cli_common"} | {f"snapkv_rag.app.{p.stem}" for p in app}) == []
    relative = [
        f"{p.name}:{node.lineno} imports ..{node.module}"
        for p in app
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module not in ("errors", "integrations", "cli_common")
    ]
    assert relative == []


def test_the_surface_check_catches_an_internal_import(tmp_path):
    bad = tmp_path / "glue.py"
    bad.write_text("from snapkv_rag.engine.shared import shared_engine\nfrom snapkv_rag.integrations import _LAZY\nimport snapkv_rag\n")
    assert surface_violations([bad], PUBLIC_SURFACE) == [
        "glue.py:1 imports snapkv_rag.engine.shared",
        "glue.py:2 imports the private name snapkv_rag.integrations._LAZY",
    ]


def test_the_package_never_imports_the_benchmarks():
    found = [f"{p.relative_to(REPO)}:{line} imports {m}" for p in PACKAGE.rglob("*.py") for m, _, line in absolute_imports(p) if m.split(".")[0] == "eval"]
    assert found == []


# The public surface for integrations, pinned: removing or renaming a name breaks connectors and users.
INTEGRATIONS = [
    "AUTO", "AUTOS", "AUTO_DOCUMENTS", "AgentMemory", "Answer", "ContextBudgetError", "DEFAULT_COMPRESSION", "DEFAULT_MAX_FILE_BYTES", "DocumentKept",
    "DocumentQA", "DocumentStore", "Embedder",
    "EmptyCollectionError", "EvidenceAttributor", "IngestReport", "IntakeError", "LESS", "RenderedHistory", "Reranked", "SUPPORTED_SUFFIXES",
    "SYSTEM_PROMPT", "Skipped", "StoreError", "StoreUnavailableError", "StoredChunk", "StuffedContext", "StuffingRetriever",
    "TEXT_ROUTES", "Upload", "adapter_option", "as_policy", "attention_rerank",
    "build_messages", "can_roll", "fit_to_window", "parse_compression", "reads_past_window", "cache_root", "check_kv_reuse",
    "citation_prf", "cite_with_support", "declared_context_length", "default_embedder_path",
    "default_store_dir", "folder_files", "kept_per_document", "make_client", "offer_segments", "pack_greedy", "parse_citations",
    "recording_kept_indices", "remove_skipped_uploads", "resolve_kv_reuse", "reuse_kwargs", "save_uploads",
    "segment_store_at", "shared_engine", "small_model_note", "validate_collection_name",
]  # fmt: skip


def test_the_integrations_surface_is_pinned_and_every_name_resolves():
    import snapkv_rag.integrations as integrations

    assert integrations.__all__ == sorted(INTEGRATIONS)
    for name in integrations.__all__:
        assert getattr(integrations, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'engine'"):
        integrations.engine  # noqa: B018


def test_type_checkers_see_the_same_names_from_the_same_modules():
    """The ``TYPE_CHECKING`` imports of integrations.py (what mypy checks callers against) and its
    lazy table (what runs) name the same objects."""
    import snapkv_rag.integrations as integrations

    tree = ast.parse((PACKAGE / "integrations.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    typed = {a.asname or a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert typed == integrations._LAZY


def test_importing_the_public_surface_loads_no_torch():
    import subprocess

    code = "import sys, snapkv_rag, snapkv_rag.integrations, snapkv_rag.errors; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_no_two_package_folders_share_a_name():
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]
    names = [p.name for p in folders]
    assert len(folders) > 10
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_importing_the_package_installs_no_import_hooks():
    """No compatibility shims: old module paths are not aliased by a finder on sys.meta_path."""
    import subprocess

    code = "import sys; before = list(sys.meta_path); import snapkv_rag, snapkv_rag.integrations; print(len(sys.meta_path) - len(before))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "0"

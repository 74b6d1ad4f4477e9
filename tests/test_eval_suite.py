"""The benchmark suite (eval/) as a package: every benchmark imports, parses its arguments and is
listed by the runner, and none reaches into tests/, examples or the package's private names.

Fast: nothing here loads a model or runs a benchmark (``--dry-run`` only parses the arguments).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "eval"
AREAS = ["compression", "decoding", "reuse", "rag", "agents", "serving", "tune", "gpu"]
SHARED = ["common"]
# the arguments a benchmark needs before it parses at all (required options); the rest need none
REQUIRED_ARGS = {"less_domains": ["--specs", "less:base=snapkv"], "rolling_prefill": ["--part", "tiny"]}


def python_files() -> list[Path]:
    """Every Python file of the suite (result folders hold none)."""
    return sorted(p for p in EVAL.rglob("*.py") if "results" not in p.relative_to(EVAL).parts and "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def benchmark_files() -> dict[str, Path]:
    """The benchmark modules, found on disk: the Python files of the area folders."""
    return {p.stem: p for area in AREAS for p in sorted((EVAL / area).glob("*.py")) if p.stem != "__init__"}


def run_eval(*argv: str) -> tuple[int, str, str]:
    """``python -m eval argv...`` in this process: (status, stdout, stderr)."""
    from eval import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = run(list(argv))
        except SystemExit as exc:  # the runner should return a status; an escaping exit is counted too
            status = exc.code if isinstance(exc.code, int) else 1
    return status, out.getvalue(), err.getvalue()


def test_the_top_level_is_an_index_with_no_benchmark_beside_it():
    entries = sorted(p.name for p in EVAL.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries
    assert {"__init__.py", "__main__.py", "RESULTS.md", *AREAS, *SHARED} <= set(entries), entries
    assert [p.name for p in EVAL.glob("*.py")] and {p.name for p in EVAL.glob("*.py")} <= {"__init__.py", "__main__.py"}
    for area in AREAS:
        folder = EVAL / area
        assert (folder / "__init__.py").is_file() and (folder / "RESULTS.md").is_file() and (folder / "results").is_dir(), area
    assert not (EVAL / "results").exists()  # every result folder lives under its area


def test_every_module_imports_and_leaves_sys_path_alone():
    before = list(sys.path)
    names = [module_name(p) for p in python_files() if p.name != "__main__.py"]  # __main__ runs the runner
    assert len(names) > 30
    for name in names:
        module = importlib.import_module(name)
        assert (module.__doc__ or "").strip(), f"{name} has no docstring"
    assert sys.path == before


def test_every_benchmark_has_build_parser_and_main():
    from eval import benchmarks

    found = benchmarks()
    assert set(found) == set(benchmark_files()) and len(found) > 20
    for name, module_path in found.items():
        module = importlib.import_module(module_path)
        assert module_path == module_name(benchmark_files()[name])
        assert isinstance(module.build_parser(), argparse.ArgumentParser), name
        parameters = inspect.signature(module.main).parameters
        assert list(parameters) == ["argv"] and parameters["argv"].default is None, name
        source = benchmark_files()[name].read_text()
        assert 'if __name__ == "__main__":\n    raise SystemExit(main())' in source, name


def test_the_runner_lists_every_benchmark_and_nothing_else():
    listed = subprocess.run([sys.executable, "-m", "eval", "--list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = [line.split(maxsplit=2) for line in listed.splitlines() if line.strip()]
    assert sorted(r[0] for r in rows) == sorted(benchmark_files())
    for name, area, summary in rows:
        assert benchmark_files()[name].parent.name == area and summary.strip(), name
    assert "harness_tasks" in {r[0] for r in rows}  # what eval/run_all.sh ran


def test_dry_run_parses_each_benchmarks_arguments():
    assert len(benchmark_files()) > 20
    for name, path in benchmark_files().items():
        status, out, err = run_eval("--dry-run", name, *REQUIRED_ARGS.get(name, []))
        assert status == 0, f"{name}: {err}"
        assert f"eval.{path.parent.name}.{name}.main(" in out, name
        module = importlib.import_module(f"eval.{path.parent.name}.{name}")
        out_default = getattr(module.build_parser().parse_args(REQUIRED_ARGS.get(name, [])), "out", None)
        if out_default is not None:  # results land in the benchmark's own area
            assert Path(out_default).resolve().is_relative_to(path.parent / "results"), f"{name}: {out_default}"


def test_dry_run_refuses_unknown_names_and_bad_arguments():
    assert run_eval("--dry-run", "no_such_benchmark")[0] != 0
    assert run_eval("no_such_benchmark")[0] != 0
    status, _, err = run_eval("--dry-run", "chunk_reuse", "--no-such-option")
    assert status != 0 and "unrecognized arguments" in err
    assert run_eval("--dry-run", "less_domains")[0] != 0  # --specs is required
    assert run_eval("--dry-run")[0] != 0 and run_eval()[0] != 0


def test_harness_tasks_write_under_their_areas():
    from eval.compression import harness_tasks

    run_all_default = "speed batch needle sensitivity citation attribution window fidelity less less-h2o less-gap"  # eval/run_all.sh's
    assert harness_tasks.DEFAULT_TASKS == run_all_default.split()
    for command in harness_tasks.commands(list(harness_tasks.TASKS)):
        out = command.split("--out ", 1)[1].split()[0]
        assert out.startswith(("eval/compression/results/", "eval/rag/results/", "eval/serving/results/")), command
        argv = harness_tasks.argv_of(command)
        assert argv[:2] == [sys.executable, "-m"] and argv[2] in ("snapkv_rag.cli", "eval"), argv


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in python_files()]


def test_no_file_edits_sys_path():
    """No module touches the import path at all: ``sys.path`` in any form (a call, an assignment, a
    slice) or ``from sys import path``; benchmarks import as the ``eval`` package."""

    def is_sys_path(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys"

    offenders = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if is_sys_path(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} uses sys.path")
            elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports sys.path")
    assert not offenders


def test_no_import_from_tests_examples_or_private_names():
    offenders = []
    for path, tree in _trees():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names], []
            elif isinstance(node, ast.ImportFrom):
                modules, names = [node.module or ""], [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                offenders.append(f"{where}:{node.lineno} reaches into .{node.attr}")
                continue
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] in ("conftest", "tests") or "examples" in parts or parts[-1] in ("long_log_agent",):
                    offenders.append(f"{where}:{node.lineno} imports {module}")
                if parts[0] == "snapkv_rag" and any(p.startswith("_") for p in parts[1:]):
                    offenders.append(f"{where}:{node.lineno} imports private module {module}")
                if parts[0] == "snapkv_rag" and any(n.startswith("_") and not n.startswith("__") for n in names):
                    offenders.append(f"{where}:{node.lineno} imports a private name from {module}")
    assert not offenders


def _slug(title: str) -> str:  # GitHub's anchor of a heading
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_the_results_pages_link_to_what_exists():
    """The index and the area pages: every relative link names a file that exists, every anchor a heading."""
    pages = [EVAL / "RESULTS.md", *(EVAL / area / "RESULTS.md" for area in AREAS)]
    assert len((EVAL / "RESULTS.md").read_text().splitlines()) <= 80
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and anchor not in {_slug(line.lstrip("#")) for line in resolved.read_text().splitlines() if line.startswith("#")}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
        assert "eval/results/" not in page.read_text().replace("eval/results/int8_linear", ""), page
    assert not broken
    for area in AREAS:  # every area page is linked from the index
        assert f"]({area}/RESULTS.md" in (EVAL / "RESULTS.md").read_text(), area

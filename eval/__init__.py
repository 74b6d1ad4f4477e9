"""The benchmark suite: the scripts that measure snapkv-rag on the embedded model and write the
numbers, tables and plots of RESULTS.md and its area pages. The evaluation harness they build on
(``snapkv-rag eval``: needle, speed, fidelity, citation runs and their metrics) is the package's
:mod:`snapkv_rag.harness`; this folder is not shipped. Benchmarks measure the package's internals,
so unlike the connectors (held to :mod:`snapkv_rag.integrations`) they may import any of its modules,
never a private name, nothing from tests or examples, and no ``sys.path`` edits.

Each area folder (compression, decoding, reuse, rag, agents, serving, tune, gpu) holds benchmark
modules, its page (``RESULTS.md``) and its ``results/``; ``common/`` holds what several share.
A benchmark module has ``build_parser()`` and ``main(argv)``; its name is its module name::

    python -m eval --list                       # every benchmark: name, area, what it measures
    python -m eval NAME [args...]               # run one (its main(args))
    python -m eval --dry-run NAME [args...]     # only parse the arguments and print them
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = {"common"}  # folders of helpers, not benchmarks
USAGE = "usage: python -m eval --list | NAME [args...] | --dry-run NAME [args...]"


def benchmarks() -> dict[str, str]:
    """Every benchmark, ``{name: "eval.area.module"}``: the modules of the area folders."""
    found = {}
    for path in sorted(HERE.glob("*/*.py")):
        area = path.parent.name
        if area in SHARED or path.stem == "__init__" or not (path.parent / "__init__.py").exists():
            continue
        if path.stem in found:
            raise RuntimeError(f"two benchmarks named {path.stem}: {found[path.stem]} and eval.{area}.{path.stem}")
        found[path.stem] = f"eval.{area}.{path.stem}"
    return found


def summary(module: str) -> str:
    """The first line of a benchmark's docstring, read without importing it (no torch for --list)."""
    path = HERE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _lookup(name: str) -> str | None:
    module = benchmarks().get(name)
    if module is None:
        print(f"python -m eval: no benchmark named {name!r} (python -m eval --list shows them)", file=sys.stderr)
    return module


def run(argv: list[str]) -> int:
    """The runner behind ``python -m eval``; returns the exit status."""
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n")[0])
        return 0
    if argv[0] == "--list":
        if argv[1:]:
            print(f"python -m eval --list takes no arguments, got {' '.join(argv[1:])}", file=sys.stderr)
            return 2
        names = benchmarks()
        width = max(map(len, names))
        for name, module in names.items():
            print(f"{name:<{width}}  {module.split('.')[1]:<11}  {summary(module)}")
        return 0
    dry_run = argv[0] == "--dry-run"
    if dry_run:
        argv = argv[1:]
        if not argv:
            print(USAGE, file=sys.stderr)
            return 2
    name, args = argv[0], argv[1:]
    module_name = _lookup(name)
    if module_name is None:
        return 2
    module = importlib.import_module(module_name)
    if not dry_run:
        result = module.main(args)
        return result if isinstance(result, int) else 0
    try:
        parsed = module.build_parser().parse_args(args)
    except SystemExit as exc:  # argparse's message is printed; --help exits 0
        return exc.code if isinstance(exc.code, int) else 2
    print(f"{module_name}.main({args!r}) would run with:")
    for key, value in vars(parsed).items():
        print(f"  {key} = {value!r}")
    return 0

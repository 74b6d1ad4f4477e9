"""Every command and link in the README, the docs pages, the connectors' READMEs and the
benchmark results pages works as written, checked without running anything heavy:

- ``snapkv-rag ...`` parses with the real command line (argparse of :func:`snapkv_rag.cli.build_parser`);
- ``python -m eval NAME ...`` parses with that benchmark's own parser (``python -m eval --dry-run``);
- ``bash scripts/x.sh``, ``python path/x.py`` and ``streamlit run path/x.py`` name files that exist;
- every relative link names a file that exists, and its ``#anchor`` a heading of that file.

Commands are read from ```bash/```sh/```console blocks and from inline code spans that start
with one of those programs; a fenced block marked ``<!-- commands: not checked -->`` is skipped.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "connectors").glob("*/README.md"), *(ROOT / "eval").rglob("RESULTS.md")],
)
FENCE = re.compile(r"(?P<skip><!-- commands: not checked -->\s*\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# what a checked command starts with, after environment assignments and a venv prefix
PROGRAMS = ("snapkv-rag", "python -m eval", "python eval/", "bash scripts/", "bash eval/", "streamlit run")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def shell_lines(body: str) -> list[str]:
    """A fenced block's commands: continuation lines joined, prompts and comments dropped."""
    out, pending = [], ""
    for raw in body.splitlines():
        line = raw.rstrip()
        if line.startswith("$ "):
            line = line[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if out and not pending and line[:1].isspace() and line.lstrip().startswith(("[", "--")):  # a usage line wrapped
            out[-1] += " " + line.strip()
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def segments(line: str) -> list[str]:
    """The simple commands of a shell line (split at ``&&``, ``||``, ``;``, ``|``), each without
    leading ``VAR=value`` assignments, ``export``s, ``timeout N`` or a ``.venv/bin/`` prefix."""
    out = []
    line = re.sub(r"\[([^\[\]|]*?)\s+\|\s+[^\[\]]*\]", r"[\1]", line)  # usage "[--store DIR | --chroma-url URL]": the first
    for part in re.split(r"\s*(?:&&|\|\||;)\s*|\s+\|\s+", line):
        part = re.sub(r"\s+[12]?>\s*\S+|\s+&$", "", part).strip()  # redirections, background
        while True:
            stripped = re.sub(r"^(?:export\s+)?[A-Z_][A-Z0-9_]*=\S*\s*|^timeout\s+\d+\s+|^(?:OMP_NUM_THREADS=\d+\s+)?taskset\s+-c\s+\S+\s+", "", part)
            if stripped == part:
                break
            part = stripped
        part = re.sub(r"^(?:\./)?\.venv/bin/", "", part)
        part = re.sub(r"^python3?(?:\.\d+)?\b", "python", part)
        if part.startswith(PROGRAMS):
            out.append(part)
    return out


def commands(page: Path) -> list[tuple[str, bool]]:
    """``(command, is a mention in prose)`` for every checked command of ``page``."""
    text = page.read_text()
    found = []
    for block in FENCE.finditer(text):
        if block.group("lang") in SHELL_LANGS and not block.group("skip"):
            found += [(s, False) for line in shell_lines(block.group("body")) for s in segments(line)]
    prose = FENCE.sub("", text)
    found += [(s, True) for span in INLINE.findall(prose) for s in segments(span)]
    return found


def subcommand_parser(argv: list[str]):
    """The parser of the deepest subcommand ``argv`` names, and the arguments after it."""
    from snapkv_rag.cli import build_parser

    parser, rest = build_parser(), list(argv)
    while rest:
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not subs or rest[0] not in subs[0].choices:
            break
        parser, rest = subs[0].choices[rest[0]], rest[1:]
    return parser, rest


def check_command(command: str, *, mention: bool = False) -> str | None:
    """None when ``command`` works as written, else why not. A ``mention`` (inline code in prose)
    may leave out required arguments: its subcommand and the options it names must exist.
    Usage brackets (``[--store DIR]``) are read as their contents; ``# ...`` ends the command."""
    try:
        argv = shlex.split(command.replace("[", " ").replace("]", " "), comments=True)
        argv = [a.split("|")[0] if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", a) else a for a in argv]  # "needle|speed": the first
    except ValueError as exc:
        return f"does not split as a shell line: {exc}"
    if argv[0] == "snapkv-rag":
        if any("/" in a for a in argv[1:2]):  # "ingest/ask": two commands named at once
            return None
        parser, rest = subcommand_parser(argv[1:])
        if mention:
            unknown = [a.split("=")[0] for a in rest if a.startswith("--") and a.split("=")[0] not in parser._option_string_actions]
            if rest and not rest[0].startswith("-") and parser.prog == "snapkv-rag":
                return f"snapkv-rag has no command {rest[0]!r}"
            return f"{parser.prog} has no option {', '.join(unknown)}" if unknown else None
        from snapkv_rag.cli import build_parser

        args: list[str] = []
        for i, a in enumerate(argv[1:], 2):  # "--compression ..." (any value) and a closing "..." (more options) in a usage line
            if a == "..." and args and args[-1] in parser._option_string_actions:
                args.pop()
            elif a != "..." or i < len(argv):
                args.append(a)
        for i, a in enumerate(args[1:], 1):  # a placeholder (N, DIR) for a number: any number will do
            action = parser._option_string_actions.get(args[i - 1])
            if re.fullmatch(r"[A-Z][A-Z_0-9]*", a) and action is not None and action.type in (int, float):
                args[i] = "1"
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            return None if exc.code == 0 else "snapkv-rag refuses these arguments"
        return None
    if argv[:3] == ["python", "-m", "eval"]:
        from eval import run

        args = argv[3:]
        if mention and args and args[0].isupper():  # python -m eval NAME: a placeholder
            return None
        try:
            code = run(["--dry-run", *args]) if args and not args[0].startswith("-") else run(args or ["--list"])
        except SystemExit as exc:
            code = exc.code
        return None if code in (0, None) else "python -m eval refuses it"
    if argv[0] in ("bash", "python") or argv[:2] == ["streamlit", "run"]:
        script = argv[2] if argv[0] == "streamlit" else argv[1]
        return None if (ROOT / script).is_file() else f"{script} does not exist"
    return f"unknown program {argv[0]}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def generated_source(path: Path) -> Path:
    """The file a docs page that docs/hooks.py generates for the site is made from (the front page
    from README.md, results.md and results/AREA.md from eval/'s RESULTS pages); any other path as is."""
    docs = ROOT / "docs"
    if path == docs / "index.md":
        return ROOT / "README.md"
    if path == docs / "results.md":
        return ROOT / "eval" / "RESULTS.md"
    if path.parent == docs / "results":
        return ROOT / "eval" / path.stem / "RESULTS.md"
    return path


def broken_links(page: Path) -> list[str]:
    out = []
    text = FENCE.sub("", page.read_text())
    text = INLINE.sub("", text)
    for m in LINK.finditer(text):
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = generated_source((page.parent / path).resolve()) if path else page
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target}: no heading with that anchor in {rel(dest)}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_command_on_the_page_works_as_written(page):
    failures = {command: why for command, mention in commands(page) if (why := check_command(command, mention=mention))}
    assert failures == {}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_link_on_the_page_resolves(page):
    assert broken_links(page) == []


def test_the_pages_hold_commands_to_check():
    found = {rel(p): [c for c, _ in commands(p)] for p in PAGES}
    assert sum(map(len, found.values())) > 50
    assert any(c.startswith("snapkv-rag ask") for c in found["README.md"]) or any("quickstart" in c for c in found["README.md"])
    assert any(c.startswith("python -m eval") for c in found["eval/RESULTS.md"])


def test_the_checks_catch_what_they_are_for(tmp_path):
    assert segments("HF_HUB_OFFLINE=1 .venv/bin/snapkv-rag ask 'q?' --collection c && echo done") == ["snapkv-rag ask 'q?' --collection c"]
    assert check_command("snapkv-rag ask 'q?' --collection c") is None
    assert check_command("snapkv-rag ask 'q?' --no-such-option") is not None
    assert check_command("snapkv-rag no-such-command") is not None
    assert check_command("snapkv-rag ask", mention=True) is None and check_command("snapkv-rag ask") is not None
    assert check_command("snapkv-rag ask --no-such-option", mention=True) is not None
    assert check_command("snapkv-rag no-such-command", mention=True) is not None
    assert check_command("snapkv-rag ask 'q?' --collection c [--store DIR]   # a comment") is None
    assert check_command('snapkv-rag ask "..." --collection c [--compression ...] [--kv-cache-bytes N] ...') is None
    assert shell_lines("snapkv-rag ask q --collection c\n    [--order score|source] [--no-such]\n") == [
        "snapkv-rag ask q --collection c [--order score|source] [--no-such]"
    ]
    assert segments("snapkv-rag ingest P --collection c [--store DIR | --chroma-url URL] [--json]") == [
        "snapkv-rag ingest P --collection c [--store DIR] [--json]"
    ]
    assert check_command("snapkv-rag ask q --collection c [--order score|source] [--no-such]") is not None
    assert check_command("snapkv-rag eval needle|speed --budgets 256") is None
    assert check_command("python eval/no_such_script.py --x 1") is not None
    assert check_command("bash scripts/test.sh") is None
    assert check_command("python -m eval no_such_benchmark") is not None
    page = tmp_path / "page.md"
    page.write_text("# Title here\n\n[ok](#title-here) [gone](missing.md) [bad](#nowhere)\n")
    assert broken_links(page) == ["missing.md: no such file", "#nowhere: no heading with that anchor in page.md"]


def test_the_readme_is_a_front_door():
    """At most 90 lines; the two commands each on its own short line; the LlamaIndex and LangChain
    uses (what the toolkit is for) within its first 60 lines."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 90
    blocks = [s for s, mention in commands(ROOT / "README.md") if not mention]
    assert blocks[:2] == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    examples = [m for m in FENCE.finditer("\n".join(lines)) if m.group("lang") == "python"]
    llama_index, langchain = examples[0], examples[1]
    assert "SnapKVLLM(" in llama_index.group("body") and "ChatSnapKV(" in langchain.group("body") and "create_agent(" in langchain.group("body")
    last_code_line = "\n".join(lines).count("\n", 0, langchain.end("body"))  # its body ends with its last line's newline
    assert last_code_line <= 60

"""Read files into plain text, one :class:`SourceText` per document, or say why a file was skipped.

Supported: ``.txt``, ``.md``/``.markdown``, ``.html``/``.htm`` (scripts and styles dropped),
``.pdf`` (pypdf), ``.json`` (an object or a list of objects) and ``.jsonl`` (one object a
line) with a text field. Every bad file (empty, binary, unreadable, undecodable, too large,
unsupported, JSON nested deeper than :data:`MAX_JSON_DEPTH`) becomes one :class:`Skipped` with its
reason; it never stops the others.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

TEXT_SUFFIXES = {".txt", ".md", ".markdown"}
HTML_SUFFIXES = {".html", ".htm"}
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES | {".pdf", ".json", ".jsonl"}
DEFAULT_MAX_FILE_BYTES = 50 * 1024 * 1024
# Arrays and objects nested deeper than this are refused before parsing: Python's JSON parser
# recurses once per level and a 100,000-deep "[[[..." raised RecursionError out of the whole ingest.
# Records are flat in practice (a text field, a title, some metadata); serde_json's default is 128 too.
MAX_JSON_DEPTH = 128


@dataclass(frozen=True)
class SourceText:
    source: str  # absolute path; a JSON record adds "#<index>"
    title: str
    text: str


@dataclass(frozen=True)
class Skipped:
    source: str
    reason: str

    def __str__(self) -> str:
        return f"skipped {self.source}: {self.reason}"


class _SkipFile(Exception):
    pass


def iter_files(paths: Iterable[str | os.PathLike]) -> Iterator[Path | Skipped]:
    """Files under ``paths`` (folders recursively, sorted). A hidden file or folder inside a
    folder (name starting with '.') is not read, and is reported once as skipped."""
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                parts = child.relative_to(path).parts
                hidden = [i for i, part in enumerate(parts) if part.startswith(".")]
                if hidden:
                    if hidden[0] == len(parts) - 1:  # the topmost hidden entry only, not what lies under it
                        kind = "folder" if child.is_dir() else "file"
                        yield Skipped(str(child.resolve()), f"hidden {kind} (name starts with '.'); name it explicitly to ingest it")
                    continue
                if child.is_file():
                    reason = unsupported_reason(child.suffix)
                    yield child.resolve() if reason is None else Skipped(str(child.resolve()), reason)
        elif path.is_file():
            yield path.resolve()
        else:
            yield Skipped(str(path), "no such file or folder")


BINARY = "binary file (contains NUL bytes)"


def unsupported_reason(suffix: str) -> str | None:
    return None if suffix.lower() in SUPPORTED_SUFFIXES else f"unsupported file type {suffix or '(none)'!r}"


def is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


def _decode(data: bytes) -> str:
    if is_binary(data):
        raise _SkipFile(BINARY)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        position = exc.start
    # Not UTF-8. Mostly ASCII with isolated other bytes (runs of at most two, as in "Größe") is
    # nearly always Windows-1252 / Latin-1 accented letters; detection guesses badly on so little
    # evidence ("café" came back as two CJK characters). Multi-byte encodings have longer runs.
    high_runs = [len(run) for run in re.findall(rb"[\x80-\xff]+", data)]
    if sum(high_runs) <= 0.3 * len(data) and max(high_runs, default=0) <= 2:
        try:
            return data.decode("cp1252")
        except UnicodeDecodeError:
            pass
    # Otherwise detect the encoding (Windows code pages, Shift-JIS, GB18030, ...).
    from charset_normalizer import from_bytes

    matches = from_bytes(data)
    best = matches.best()
    if best is not None:
        # Single-byte Western code pages often tie (the bytes decode alike in cp1250, cp1252, ...);
        # on a tie, take the most widely used one, Windows-1252 (a superset of Latin-1's letters).
        tied = [m for m in matches if m.chaos == best.chaos and m.coherence == best.coherence]
        best = next((m for m in tied if m.encoding == "cp1252"), best)
    if best is None or best.encoding is None:
        raise _SkipFile(
            f"not valid UTF-8 (byte {position}) and no other text encoding was recognised; convert it, e.g. iconv -f LATIN1 -t UTF-8 FILE > FILE.utf8.txt"
        )
    return str(best)


class _HTMLText(HTMLParser):
    _DROP = {"script", "style", "noscript", "template", "svg"}
    _BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "pre", "table"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self._stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        self._stack.append(tag)
        if tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in self._stack:
            while self._stack and self._stack.pop() != tag:
                pass
        if tag in self._BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if any(t in self._DROP for t in self._stack):
            return
        if "title" in self._stack:
            self.title += data
            return
        self.parts.append(data)


def _html_text(markup: str) -> tuple[str, str]:
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    text = re.sub(r"[ \t\r\f\v]+", " ", "".join(parser.parts))
    text = re.sub(r"\s*\n\s*\n\s*", "\n\n", text).strip()
    return parser.title.strip(), text


def _pdf_text(path: Path) -> tuple[str, str]:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    # pypdf logs and warns about every defect it repairs or meets; a broken file gets our one skip line instead.
    pypdf_logger = logging.getLogger("pypdf")
    level = pypdf_logger.level
    pypdf_logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = PdfReader(str(path))
            if reader.is_encrypted:
                raise _SkipFile("encrypted PDF")
            pages = [page.extract_text() or "" for page in reader.pages]
            title = (reader.metadata.title if reader.metadata else None) or ""
    except (PdfReadError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise _SkipFile(f"unreadable PDF ({exc})") from None
    finally:
        pypdf_logger.setLevel(level)
    return str(title).strip(), "\n\n".join(p.strip() for p in pages if p.strip())


def _first_line_title(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip().lstrip("#").strip()[:200]
    return ""


# A JSON string (an unterminated one runs to the end, so every match succeeds and the scan stays linear)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_TOO_DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects (the most a JSON record may nest)"


def json_too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON ``text`` nests arrays and objects deeper than ``limit`` (brackets inside strings
    do not count). Counted without parsing or recursion, in linear time."""
    if text.count("[") + text.count("{") <= limit:  # too few openers to get there
        return False
    import numpy as np

    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).encode("ascii")
    depth = 0
    step = 1 << 20
    for lo in range(0, len(brackets), step):
        codes = np.frombuffer(brackets, dtype=np.uint8, count=min(step, len(brackets) - lo), offset=lo)
        levels = np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1), dtype=np.int64) + depth
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
    return False


def _json_records(path: Path, text: str, text_field: str, dropped: list[Skipped] | None) -> list[SourceText]:
    jsonl = path.suffix.lower() == ".jsonl"
    if jsonl:
        records, lines = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                if json_too_deep(line):
                    raise _SkipFile(f"line {number} is {_TOO_DEEP}")
                try:
                    records.append(json.loads(line))
                    lines.append(number)
                except json.JSONDecodeError as exc:
                    raise _SkipFile(f"invalid JSON on line {number}: {exc.msg}") from None
    else:
        if json_too_deep(text):
            raise _SkipFile(_TOO_DEEP)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _SkipFile(f"invalid JSON: {exc.msg} (line {exc.lineno})") from None
        records = data if isinstance(data, list) else [data]
    out, missing = [], []
    for index, record in enumerate(records):
        value = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(value, str) and value.strip():
            title = record.get("title") if isinstance(record.get("title"), str) else f"{path.stem} #{index}"
            out.append(SourceText(f"{path}#{index}", title, value.strip()))
        else:
            where = f"line {lines[index]}" if jsonl else f"record {index}"
            missing.append(Skipped(f"{path}#{index}", f"{where} has no non-empty string field {text_field!r}"))
    if not out:
        raise _SkipFile(f"no record has a non-empty string field {text_field!r}")
    if dropped is not None:
        dropped.extend(missing)
    return out


def load_file(
    path: Path, *, text_field: str = "text", max_bytes: int = DEFAULT_MAX_FILE_BYTES, dropped: list[Skipped] | None = None
) -> list[SourceText] | Skipped:
    """The documents in one file, or why it was skipped. JSON records without the text field
    are appended to ``dropped`` (when given) while the file's other records load."""
    source = str(path)
    suffix = path.suffix.lower()
    try:
        reason = unsupported_reason(suffix)
        if reason is not None:
            raise _SkipFile(reason)
        size = path.stat().st_size
        if size == 0:
            raise _SkipFile("empty file")
        if size > max_bytes:
            raise _SkipFile(f"too large ({size / 2**20:.1f} MiB > {max_bytes / 2**20:.1f} MiB limit)")
        if suffix == ".pdf":
            title, text = _pdf_text(path)
        else:
            raw = _decode(path.read_bytes())
            if suffix in (".json", ".jsonl"):
                return _json_records(path, raw, text_field, dropped)
            if suffix in HTML_SUFFIXES:
                title, text = _html_text(raw)
            else:
                title, text = _first_line_title(raw), raw.strip()
        if not text.strip():
            raise _SkipFile("no text in the file")
        return [SourceText(source, title or path.stem, text)]
    except _SkipFile as exc:
        return Skipped(source, str(exc))
    except OSError as exc:
        return Skipped(source, f"unreadable ({exc.strerror or exc})")
    except RecursionError:  # the last resort (depth is checked before parsing): a file nested too deeply to read
        return Skipped(source, "nested too deeply to read (a parser ran out of stack)")

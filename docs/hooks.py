"""MkDocs hook: the site's front page is the README, and its Results pages are eval/'s RESULTS pages.

They live where readers of the repository look for them; this publishes them in the site
(``index.md``; ``results.md``, the suite's index page eval/RESULTS.md; ``results/<area>.md``,
each area's page eval/<area>/RESULTS.md, with its plots under ``results/<area>/``), their links
rewritten from the repository's layout to the site's, so none is copied by hand. Docs pages may
link the results either way (``results/<area>.md#...`` or ``../eval/<area>/RESULTS.md#...``).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "eval"


def area_pages() -> dict[str, Path]:
    """``{area: eval/<area>/RESULTS.md}`` for every area folder that has a page."""
    return {page.parent.name: page for page in sorted(EVAL.glob("*/RESULTS.md"))}


def _github_slug(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _site_slug(title: str) -> str:  # what the toc extension makes of a heading (inline code keeps its text)
    value = unicodedata.normalize("NFKD", title.replace("`", "")).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", value).strip().lower())


def site_anchors() -> dict[str, str]:
    """GitHub's anchor of a results heading -> the site's, where the two differ (GitHub keeps "---")."""
    out = {}
    for page in [EVAL / "RESULTS.md", *area_pages().values()]:
        for line in page.read_text().splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip()
                if _github_slug(title) != _site_slug(title):
                    out[_github_slug(title)] = _site_slug(title)
    return out


def _anchors(text: str) -> str:
    for github, site in site_anchors().items():
        text = text.replace(f".md#{github})", f".md#{site})")
    return text


def _name_outside(text: str, *, with_anchors: bool = False) -> str:
    """Links to files the site does not hold (a folder, a record file): named instead. The README's
    links to a page's section are named too (``with_anchors=False``, as before); the results pages'
    are kept, and the build checks their anchors."""

    def outside(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        path = target.split("#", 1)[0] if with_anchors else target
        if target.startswith(("http", "#")) or path.endswith(".md") or path.endswith(".png"):
            return match.group(0)
        return f"{label} (`{target}`)"

    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)]*)\)", outside, text)


def front_page(readme: str) -> str:
    """The README with links relative to ``docs/`` (pages) instead of the repository root."""
    text = readme.replace("](docs/", "](").replace("](eval/RESULTS.md", "](results.md")
    text = re.sub(r"\]\(eval/(\w+)/RESULTS\.md", r"](results/\1.md", text)
    text = text.replace("The pages under [`docs/`]() are the reference", "These pages are the reference")
    return _name_outside(text)


def results_index(text: str) -> str:
    """eval/RESULTS.md as ``results.md``: its links to area pages point at ``results/<area>.md``."""
    return _anchors(_name_outside(re.sub(r"\]\((\w+)/RESULTS\.md", r"](results/\1.md", text), with_anchors=True))


def results_area(text: str, area: str) -> str:
    """eval/<area>/RESULTS.md as ``results/<area>.md``: links to the other pages and to its plots."""
    text = re.sub(r"\]\(\.\./RESULTS\.md", "](../results.md", text)
    text = re.sub(r"\]\(\.\./(\w+)/RESULTS\.md", r"](\1.md", text)
    text = re.sub(r"\]\(RESULTS\.md#", "](#", text)
    text = re.sub(r"(!\[[^\]]*\]\()results/", rf"\g<1>{area}/", text)
    text = re.sub(r"\]\(\.\./\.\./docs/", "](../", text)  # the docs pages, from results/<area>.md
    # a results table (results/<run>/table.md) is not a page of the site: named, not linked
    text = re.sub(r"(?<!!)\[([^\]]+)\]\((results/[^)#]+\.md)\)", rf"\1 (`eval/{area}/\2`)", text)
    return _anchors(_name_outside(text, with_anchors=True))


def docs_page(text: str) -> str:
    """A docs page's links into eval/ written as repository paths (``../eval/<area>/RESULTS.md``)."""

    def site(match: re.Match) -> str:
        up = match.group(1).count("../") - 1  # the repository root is one level above docs/
        return "](" + "../" * up + (f"results/{match.group(2)}.md" if match.group(2) else "results.md")

    return _anchors(re.sub(r"\]\(((?:\.\./)+)eval/(?:(\w+)/)?RESULTS\.md", site, text))


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=front_page((ROOT / "README.md").read_text())))
    files.append(File.generated(config, "results.md", content=results_index((EVAL / "RESULTS.md").read_text())))
    for area, page in area_pages().items():
        files.append(File.generated(config, f"results/{area}.md", content=results_area(page.read_text(), area)))
        for image in sorted((page.parent / "results").rglob("*.png")):
            files.append(File.generated(config, f"results/{area}/{image.relative_to(page.parent / 'results').as_posix()}", abs_src_path=str(image)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri in ("index.md", "results.md") or page.file.src_uri.startswith("results/"):
        return markdown
    return docs_page(markdown)

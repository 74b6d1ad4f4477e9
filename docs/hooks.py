"""MkDocs hook: the site's front page is the README, and its Results page is eval/RESULTS.md.

Both files live where readers of the repository look for them; this publishes them in the
site (``index.md``; ``results.md`` with its plots under ``results/``) with the README's
links rewritten from the repository root to the docs folder, so neither is copied by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "eval"


def front_page(readme: str) -> str:
    """The README with links relative to ``docs/`` (pages) instead of the repository root."""
    text = readme.replace("](docs/", "](").replace("](eval/RESULTS.md", "](results.md")
    text = text.replace("The pages under [`docs/`]() are the reference", "These pages are the reference")

    def outside(match: re.Match) -> str:  # a file the site does not hold: name it instead
        label, target = match.group(1), match.group(2)
        if target.startswith(("http", "#")) or target.endswith(".md") or target.endswith(".png"):
            return match.group(0)
        return f"{label} (`{target}`)"

    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)]*)\)", outside, text)


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=front_page((ROOT / "README.md").read_text())))
    files.append(File.generated(config, "results.md", abs_src_path=str(EVAL / "RESULTS.md")))
    for image in sorted((EVAL / "results").rglob("*.png")):
        files.append(File.generated(config, f"results/{image.relative_to(EVAL / 'results').as_posix()}", abs_src_path=str(image)))
    return files

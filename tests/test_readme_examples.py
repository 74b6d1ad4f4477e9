"""Every Python example in the READMEs and the docs pages runs as written, on the embedded model.

The ```python blocks of one README (or of the docs pages, in the site's navigation order) run
in order in one interpreter, as a reader pasting them one after the other would (a later
block may use what an earlier one defined), from a fresh
folder that holds only ``examples/`` (the sample corpus), with its own cache and store. A
block preceded by ``<!-- readme-example: server -->`` needs ``snapkv-rag serve`` on
127.0.0.1:8000, which the test starts for it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = ["connectors/langchain-snapkv/README.md", "connectors/llama-index-llms-snapkv/README.md", "README.md", "docs"]
BLOCK = re.compile(r"(<!-- readme-example: (?P<tag>[\w-]+) -->\n)?```python\n(?P<code>.*?)```", re.S)

pytestmark = pytest.mark.integration


# Site pages built from other files by docs/hooks.py: the README (tested on its own), eval/RESULTS.md
# and each area's eval/<area>/RESULTS.md (results/<area>.md).
GENERATED = {"index.md", "results.md", *(f"results/{page.parent.name}.md" for page in (ROOT / "eval").glob("*/RESULTS.md"))}


def docs_pages() -> list[str]:
    """The docs pages in the order of the site's navigation (mkdocs.yml), generated ones left out."""
    nav = re.findall(r"^\s+- [^:]+: ([\w/-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    return [f"docs/{page}" for page in nav if page not in GENERATED]


def python_blocks(readme: str) -> list[tuple[str | None, str]]:
    files = docs_pages() if readme == "docs" else [readme]
    return [(m.group("tag"), m.group("code")) for name in files for m in BLOCK.finditer((ROOT / name).read_text())]


def test_the_docs_navigation_lists_every_page():
    pages = set(docs_pages())
    on_disk = {f"docs/{p.relative_to(ROOT / 'docs').as_posix()}" for p in (ROOT / "docs").rglob("*.md")}
    assert pages == on_disk and len(pages) > 10


def test_every_readme_has_examples():
    for readme in READMES:
        assert python_blocks(readme), readme


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture()
def example_dir(tmp_path, embedded_engine):  # embedded_engine: the model is converted once, in the real cache
    from snapkv_rag.model.loading import cache_root

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models")
    return tmp_path


@pytest.mark.parametrize("readme", READMES)
def test_readme_python_examples_run_as_written(readme, example_dir):
    blocks = python_blocks(readme)
    env = {**os.environ, "SNAPKV_RAG_CACHE_DIR": str(example_dir / "cache"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    server = None
    if any(tag == "server" for tag, _ in blocks):
        assert not _port_open(8000), "port 8000 is taken; the server example needs it"
        server = subprocess.Popen(
            [sys.executable, "-m", "snapkv_rag.cli", "serve", "--port", "8000"],
            cwd=example_dir,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    try:
        if server is not None:
            deadline = time.monotonic() + 180
            while not _port_open(8000):
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        script = example_dir / "readme_examples.py"
        script.write_text("\n\n".join(f"# ---- block {i + 1}\n{code}" for i, (_, code) in enumerate(blocks)))
        run = subprocess.run([sys.executable, str(script)], cwd=example_dir, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"{readme}:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)

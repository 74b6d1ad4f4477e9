"""The package as a user installs it: a wheel built from this tree, installed into a fresh venv,
starts ``snapkv-rag app`` (the app ships inside the package) and runs its page, with nothing
read from the source checkout.

The fresh venv gets the wheel with ``--no-deps`` and sees the project venv's site-packages
(torch, streamlit, ...) through a ``.pth`` line; the project's own editable install is not on
that path (its finder is a ``.pth`` file of the project venv, which a ``.pth`` line does not run).
"""

from __future__ import annotations

import os
import shutil
import site
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_app import tiny_model_dir  # noqa: F401  (a session fixture: a tiny random llama folder)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """``{"venv": Path, "bin": Path, "env": dict, "cwd": Path}`` of a fresh venv holding the built wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # build from a copy: setuptools writes build/ and egg-info beside the sources
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copy(ROOT / "README.md", source)
    shutil.copytree(ROOT / "snapkv_rag", source / "snapkv_rag", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)], check=True)
    from snapkv_rag import __version__

    (wheel,) = dist.glob(f"snapkv_rag-{__version__}-*.whl")  # pyproject's version is the package's
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True)
    (Path(purelib.stdout.strip()) / "project_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    cwd = tmp / "elsewhere"  # not the checkout: nothing may be found relative to it
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", SNAPKV_RAG_APP_STORE=str(tmp / "chroma"), SNAPKV_RAG_APP_UPLOADS=str(tmp / "uploads"))
    return {"venv": venv, "bin": venv / "bin", "env": env, "cwd": cwd}


def run(installed: dict, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True, timeout=300, **kwargs)


def test_the_wheel_holds_the_app_and_imports_from_the_venv(installed):
    code = "import snapkv_rag, snapkv_rag.app.cli as c; print(snapkv_rag.__file__); print(c.APP_SCRIPT); print(c.APP_SCRIPT.is_file())"
    out = run(installed, str(installed["bin"] / "python"), "-c", code)
    assert out.returncode == 0, out.stderr
    package, script, exists = out.stdout.split()
    assert Path(package).is_relative_to(installed["venv"]) and Path(script).is_relative_to(installed["venv"]), out.stdout
    assert exists == "True"


def test_snapkv_rag_app_help_from_the_wheel(installed):
    out = run(installed, str(installed["bin"] / "snapkv-rag"), "app", "--help")
    assert out.returncode == 0, out.stderr
    assert "--adapter" in out.stdout and "--allow-folder-root" in out.stdout


def test_the_installed_page_runs(installed, tiny_model_dir):
    code = (
        "from streamlit.testing.v1 import AppTest; import snapkv_rag.app.page as page\n"
        "at = AppTest.from_file(page.__file__, default_timeout=120); at.run()\n"
        "assert not at.exception, at.exception\n"
        "print([t.value for t in at.title])\n"
    )
    env = {**installed["env"], "SNAPKV_RAG_APP_MODEL": str(tiny_model_dir)}
    out = subprocess.run([str(installed["bin"] / "python"), "-c", code], cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Document QA" in out.stdout


def test_snapkv_rag_app_starts_headless_from_the_wheel(installed, tiny_model_dir):
    port = free_port()
    env = {**installed["env"], "SNAPKV_RAG_APP_MODEL": str(tiny_model_dir)}
    server = subprocess.Popen(
        [str(installed["bin"] / "snapkv-rag"), "app", "--port", str(port)], cwd=installed["cwd"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline, health = time.monotonic() + 120, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    health = r.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert health == "ok", server.stdout.read().decode() if server.poll() is not None else "no health answer in 120 s"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert r.status == 200 and b"<html" in r.read().lower()
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0 or server.returncode in (-15, 143)

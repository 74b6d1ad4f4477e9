"""``snapkv-rag app``: start the Streamlit document-QA app (apps/docqa/app.py) of a source checkout."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

from .errors import SnapKVRagError

APP_SCRIPT = Path(__file__).resolve().parent.parent / "apps" / "docqa" / "app.py"


def add_app_parser(sub) -> None:
    p = sub.add_parser("app", help="start the Streamlit document-QA app in the browser")
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2), a model dir, a .gguf file or a hub id")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16")
    p.add_argument("--store", default=None, help="embedded Chroma directory (default ~/.cache/snapkv-rag/chroma)")
    p.add_argument("--uploads", default=None, help="where uploaded files are kept (default ~/.cache/snapkv-rag/uploads)")
    p.add_argument("--collection", default=None, help="collection selected at start (default 'documents')")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8501)
    p.set_defaults(func=cmd_app)


def app_command(args: argparse.Namespace) -> list[str]:
    """The ``streamlit run`` command line for ``args``."""
    command = [
        sys.executable, "-m", "streamlit", "run", str(APP_SCRIPT),
        "--server.address", args.host,
        "--server.port", str(args.port),
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "minimal",
        "--",
        "--model", args.model,
    ]
    for option in ("device", "dtype", "store", "uploads", "collection"):
        value = getattr(args, option)
        if value is not None:
            command += [f"--{option}", str(value)]
    return command


def cmd_app(args: argparse.Namespace) -> int:
    if not APP_SCRIPT.is_file():
        raise SnapKVRagError(f"the app ships with the source checkout ({APP_SCRIPT} is missing); clone the repository and pip install -e '.[app]'")
    if importlib.util.find_spec("streamlit") is None:
        raise SnapKVRagError("the app needs Streamlit: pip install -e '.[app]' (scripts/setup.sh installs it)")
    print(f"snapkv-rag: document QA at http://{args.host}:{args.port} (Ctrl+C stops it)", file=sys.stderr)
    try:
        return subprocess.call(app_command(args))
    except KeyboardInterrupt:
        return 130

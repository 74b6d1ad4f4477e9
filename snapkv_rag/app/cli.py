"""``snapkv-rag app``: start the Streamlit document-QA app (:mod:`.page`, shipped in the package)."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path

from snapkv_rag.integrations import AUTO_DOCUMENTS

from ..cli_common import add_model_args
from ..errors import SnapKVRagError

APP_SCRIPT = Path(__file__).resolve().parent / "page.py"


def add_app_parser(sub) -> None:
    p = sub.add_parser("app", help="start the Streamlit document-QA app in the browser")
    add_model_args(p, json_output=False, adapter_default=AUTO_DOCUMENTS)  # --model: the model the app starts with (users cannot name another)
    p.add_argument(
        "--allow-model",
        action="append",
        default=None,
        metavar="NAME_OR_PATH",
        help="another model users may choose in the sidebar (repeat for more; env SNAPKV_RAG_APP_MODELS, comma-separated); default: only --model",
    )
    p.add_argument("--store", default=None, help="embedded Chroma directory (default ~/.cache/snapkv-rag/chroma)")
    p.add_argument("--chroma-url", default=None, help="a Chroma server instead of the embedded store, e.g. http://chroma:8000 (env SNAPKV_RAG_APP_CHROMA_URL)")
    p.add_argument("--uploads", default=None, help="where uploaded files are kept (default ~/.cache/snapkv-rag/uploads)")
    p.add_argument("--collection", default=None, help="collection selected at start (default 'documents')")
    p.add_argument(
        "--allow-folder-root",
        default=None,
        metavar="DIR",
        help="let users ingest folders under DIR (default: folder ingest off; uploads only)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument(
        "--no-password",
        action="store_true",
        help="listen on a non-loopback --host without SNAPKV_RAG_APP_PASSWORD (only behind your own access control)",
    )
    p.set_defaults(func=cmd_app)


def max_upload_mb() -> int:
    """Streamlit's upload limit in MB: the largest file the loader reads (Streamlit's own default is 200)."""
    from ..integrations import DEFAULT_MAX_FILE_BYTES

    return max(1, DEFAULT_MAX_FILE_BYTES // (1 << 20))


def app_command(args: argparse.Namespace) -> list[str]:
    """The ``streamlit run`` command line for ``args``."""
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_SCRIPT),
        "--server.address",
        args.host,
        "--server.port",
        str(args.port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",
        "--server.maxUploadSize",  # MB: no larger than the loader reads, so nothing bigger is written to disk first
        str(max_upload_mb()),
        "--",
    ]
    if args.model != "default":  # else the app's own default (SNAPKV_RAG_APP_MODEL, or the embedded model)
        command += ["--model", args.model]
    if args.base_model:
        command.append("--base-model")
    if args.adapter != AUTO_DOCUMENTS:  # else the app's own default (SNAPKV_RAG_APP_ADAPTER, or auto:documents)
        command += ["--adapter", args.adapter]
    for option in ("device", "dtype", "weights", "store", "chroma_url", "uploads", "collection", "allow_folder_root"):
        value = getattr(args, option, None)
        if value is not None:
            command += [f"--{option.replace('_', '-')}", str(value)]
    for model in getattr(args, "allow_model", None) or ():  # else the app's own default (SNAPKV_RAG_APP_MODELS, or none)
        command += ["--allow-model", model]
    return command


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_app(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("streamlit") is None:
        raise SnapKVRagError("the app needs Streamlit: pip install 'snapkv-rag[app]' (scripts/setup.sh installs it)")
    if not is_loopback(args.host) and not os.environ.get("SNAPKV_RAG_APP_PASSWORD", "").strip() and not args.no_password:
        blank = " (it is set, but only to whitespace)" if os.environ.get("SNAPKV_RAG_APP_PASSWORD") else ""
        raise SnapKVRagError(
            f"--host {args.host} would let anyone who reaches this machine use the app and its documents; "
            f"set SNAPKV_RAG_APP_PASSWORD{blank} (asked for in the page), or pass --no-password when your own proxy controls access"
        )
    print(f"snapkv-rag: document QA at http://{args.host}:{args.port} (Ctrl+C stops it)", file=sys.stderr)
    return run_forwarding_signals(app_command(args))


def run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` and pass SIGTERM, SIGINT and SIGHUP on to it, so ``kill PID`` of this
    process stops the server too instead of leaving it running on its port."""
    child = subprocess.Popen(command)
    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda sig, _frame: child.send_signal(sig)) for sig in forwarded}
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # the terminal sent SIGINT to both; wait for the child to finish
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code

"""The documents panel: uploads and folder ingest into the collection, with a progress bar and a report."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from snapkv_rag.integrations import (
    DocumentStore,
    Embedder,
    IngestReport,
    IntakeError,
    Skipped,
    Upload,
    folder_files,
    remove_skipped_uploads,
    save_uploads,
    validate_collection_name,
)

from ..errors import SnapKVRagError
from .config import UPLOAD_TYPES, AppConfig, ingest_lock
from .sidebar import list_collections
from .views import md_code, md_escape


def open_store(client, embedder: Embedder, cfg: AppConfig, name: str, *, create: bool) -> DocumentStore:
    if cfg.chroma_url:
        return DocumentStore(name, client=client, embedder=embedder, url=cfg.chroma_url, create=create)
    return DocumentStore(name, client=client, embedder=embedder, path=cfg.store, create=create)


def ingest_paths(store: DocumentStore, paths: list[Path | Skipped], lock: threading.Lock) -> IngestReport:
    """Ingest with a progress bar (``DocumentStore.ingest``); bad files are reported, never fatal."""
    refused = [p for p in paths if isinstance(p, Skipped)]  # uploads turned away before ingest
    bar = st.progress(0.0, text="Waiting for another ingest into this collection…" if lock.locked() else "Starting…")
    seen = [0]

    def on_file(index: int, total: int, path: str) -> None:
        seen[0] = total
        bar.progress(index / max(1, total), text=f"Reading {Path(path).name} ({index + 1} of {total})")

    with lock:
        report = store.ingest([p for p in paths if not isinstance(p, Skipped)], on_file=on_file)
    report.skipped[:0] = refused
    files = seen[0] + len(refused)
    bar.progress(1.0, text=f"Done: {files} file{'s' if files != 1 else ''}")
    return report


def remove_unheld_uploads(saved: list[Path | Skipped], store: DocumentStore | None) -> None:
    """After an ingest that stopped (a store error, an unexpected exception), delete this batch's
    saved uploads that the collection does not hold; when what it holds cannot be read, delete none
    (an upload may replace a file the collection holds an older version of)."""
    if not saved:
        return
    try:
        held = {f["file"] for f in store.files()} if store is not None else None
    except Exception:  # the store itself is failing: leave the files
        held = None
    if held is None:
        return
    remove_skipped_uploads(saved, [Skipped(str(p), "not ingested") for p in saved if isinstance(p, Path) and str(p) not in held])


def render_report(report: dict[str, Any]) -> None:
    rep: IngestReport = report["report"]
    text = f"**{report['what']}** → `{report['collection']}`: {rep.summary()}."
    (st.success if rep.files and not rep.skipped else st.warning if rep.skipped else st.info)(text)
    for s in rep.skipped:
        st.markdown(f"- {md_code(Path(s.source).name)} was skipped: {md_escape(s.reason)}")


def documents_panel(cfg: AppConfig, client, embedder: Embedder, collection: str) -> DocumentStore | None:
    store: DocumentStore | None = None
    error = None
    if collection:
        try:
            if collection in list_collections(client):
                store = open_store(client, embedder, cfg, collection, create=False)
        except SnapKVRagError as exc:
            error = str(exc)
    files = store.files() if store is not None else []
    chunks = sum(f["chunks"] for f in files)
    title = f"Documents in {collection or '(no collection)'}: {len(files)} file{'s' if len(files) != 1 else ''}, {chunks} chunks"
    fresh = st.session_state.pop("ingest_fresh", False)
    with st.expander(title, expanded=not files or fresh, icon=":material/description:"):
        if error:
            st.error(error)
        left, right = st.columns(2, gap="large")
        with left.form("upload", clear_on_submit=True, border=False):
            uploads = st.file_uploader("Upload files", type=UPLOAD_TYPES, accept_multiple_files=True, key="uploads", help="txt, md, html, pdf, json, jsonl")
            add_files = st.form_submit_button("Add files", type="primary", key="add_files")
        add_folder = False
        if cfg.folder_root:
            with right.form("folder", border=False):
                folder = st.text_input(f"Or a folder under {cfg.folder_root}", placeholder=str(Path(cfg.folder_root) / "documents"), key="folder")
                add_folder = st.form_submit_button("Add folder", key="add_folder")
        else:
            right.caption("Folder ingest is off: whoever starts the app can allow one folder tree with `--allow-folder-root DIR`.")
        what, paths, saved = None, [], []
        try:
            if add_files or add_folder:
                validate_collection_name(collection)  # before anything is written or read
            if add_files:
                if not uploads:
                    st.warning("Choose one or more files first.")
                else:
                    saved = save_uploads([Upload(f.name, f.getvalue()) for f in uploads], cfg.uploads, collection)
                    what, paths = f"{len(uploads)} uploaded file{'s' if len(uploads) != 1 else ''}", saved
            if add_folder:
                if not folder.strip():
                    st.warning("Type a folder path first.")
                else:
                    what, paths = f"folder {folder.strip()}", folder_files(folder.strip(), cfg.folder_root)
        except (SnapKVRagError, IntakeError) as exc:
            st.error(str(exc))
            what = None
        if what is not None:
            report = None
            try:
                store = store or open_store(client, embedder, cfg, collection, create=True)
                report = ingest_paths(store, paths, ingest_lock(cfg.store, collection))
            except SnapKVRagError as exc:
                st.error(str(exc))
            finally:
                if report is None:  # the ingest stopped part-way: the uploads folder keeps only what the collection holds
                    remove_unheld_uploads(saved, store)
            if report is not None:
                remove_skipped_uploads(saved, report.skipped)
                st.session_state["ingest_report"] = {"what": what, "collection": collection, "report": report}
                st.session_state["ingest_fresh"] = True
                st.session_state["select_collection"] = collection
                st.rerun()
        last = st.session_state.get("ingest_report")
        if last and last["collection"] == collection:
            render_report(last)
        if files:
            table = pd.DataFrame(
                [
                    {"Document": Path(f["file"]).name, "Title": f["title"], "Chunks": f["chunks"], "Tokens": f["tokens"], "Folder": str(Path(f["file"]).parent)}
                    for f in files
                ]
            )
            st.table(table.set_index("Document"))
        elif store is None and not error:
            st.caption("This collection does not exist yet; it is created when you add documents.")
    return store

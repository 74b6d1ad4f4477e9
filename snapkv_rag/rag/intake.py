"""Files that arrive from people who may not own the machine: uploads and folder paths.

An app that serves others (the Streamlit app, anything behind a network port) must never let a
request choose where a file is written or which folder of the server is read:

- uploads go under one root, in a folder derived from the collection name by a hash (the name
  is validated first, and is never used as a path);
- an upload is checked in memory (name, type, empty, binary) before it is written;
- folder ingest is off unless the operator names an allowed root, and then reads only files
  that resolve inside it (symlinks included).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import SnapKVRagError
from .loaders import BINARY, Skipped, is_binary, iter_files, unsupported_reason
from .store import validate_collection_name


class IntakeError(SnapKVRagError, ValueError):
    """A folder path outside the allowed root, or folder ingest not enabled."""


@dataclass(frozen=True)
class Upload:
    name: str
    data: bytes


def upload_folder(root: str | os.PathLike, collection: str) -> Path:
    """Where ``collection``'s uploads are kept: ``root/collection-<hash>``; validates the name, creates nothing."""
    name = validate_collection_name(collection)
    return Path(root).expanduser().resolve() / f"collection-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def upload_problem(upload: Upload) -> str | None:
    """Why ``upload`` cannot be ingested (checked before anything is written), or None."""
    name = upload.name
    if not name or Path(name).name != name or name.startswith(".") or name in (".", ".."):
        return "not a valid file name (no folders, not hidden)"
    suffix = Path(name).suffix
    reason = unsupported_reason(suffix)
    if reason is not None:
        return reason
    if not upload.data:
        return "empty file"
    if suffix.lower() != ".pdf" and is_binary(upload.data):  # the loader's own test, before anything is written
        return BINARY
    return None


def save_uploads(uploads: list[Upload], root: str | os.PathLike, collection: str) -> list[Path | Skipped]:
    """Write the acceptable uploads into ``collection``'s upload folder; the others become
    :class:`Skipped` without touching the disk. Validates the collection name before anything."""
    folder = upload_folder(root, collection)
    out: list[Path | Skipped] = []
    for upload in uploads:
        problem = upload_problem(upload)
        if problem is not None:
            out.append(Skipped(upload.name or "(no name)", problem))
            continue
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / upload.name
        tmp = target.with_name(f".{target.name}.partial")
        tmp.write_bytes(upload.data)
        os.replace(tmp, target)
        out.append(target)
    return out


def remove_skipped_uploads(saved: list[Path | Skipped], skipped: list[Skipped]) -> int:
    """Delete the saved uploads that ingest then skipped (unreadable PDF, undecodable text...):
    the uploads folder keeps only what the collection holds. Returns how many were removed."""
    rejected = {s.source for s in skipped}
    removed = 0
    for path in saved:
        if isinstance(path, Path) and str(path) in rejected:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def folder_files(folder: str, allowed_root: str | os.PathLike | None) -> list[Path | Skipped]:
    """The files of ``folder`` to ingest, when folder ingest is enabled (``allowed_root``) and
    ``folder`` lies inside it; every file must resolve inside the root too (no symlink escapes)."""
    if allowed_root is None:
        raise IntakeError("folder ingest is not enabled on this server; its operator can allow a root folder with --allow-folder-root DIR")
    root = Path(allowed_root).expanduser().resolve()
    path = Path(folder).expanduser()
    if not path.is_absolute():
        path = root / path
    path = path.resolve()
    if not path.is_relative_to(root):
        raise IntakeError(f"{folder} is outside the folder this server allows ({root})")
    if not path.is_dir():
        raise IntakeError(f"{folder} is not a folder under {root}")
    out: list[Path | Skipped] = []
    for item in iter_files([path]):
        if isinstance(item, Path) and not item.resolve().is_relative_to(root):
            out.append(Skipped(str(item), f"links outside the allowed folder {root}"))
        else:
            out.append(item)
    return out

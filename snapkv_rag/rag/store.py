"""Chunks in a Chroma collection: idempotent, crash-safe ingest and similarity search.

Chroma runs embedded (``PersistentClient``, default under ``~/.cache/snapkv-rag/chroma``)
or as a server (``chroma run``) reached with ``url=``. The toolkit computes every embedding
itself and passes vectors, so Chroma never loads (or downloads) its default embedder.

Consistency: a chunk's id derives from its file, position and text, so re-ingesting an
unchanged file adds nothing. A changed file is written as a new *version* (its chunks
carry the file's hash and chunk count) before the old version's chunks are deleted.
Readers use, per file, the newest version whose chunks are all present, so a crash or
``kill -9`` at any point leaves the collection answering from whole versions, and the
next ingest completes the interrupted version and removes the stale one.
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..errors import SnapKVRagError
from .chunking import Chunk, chunk_document, text_hash
from .embeddings import Embedder
from .loaders import DEFAULT_MAX_FILE_BYTES, Skipped, SourceText, iter_files, load_file

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,510}[A-Za-z0-9]$")


class StoreError(SnapKVRagError, ValueError):
    """The collection name, store location or embedder do not fit."""


class StoreUnavailableError(SnapKVRagError, ConnectionError):
    """The Chroma server could not be reached."""


def validate_collection_name(name: object) -> str:
    """``name`` when Chroma accepts it as a collection name; StoreError otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise StoreError(
            f"collection name {name!r} is not valid: use 3-512 characters from letters, digits, '.', '_', '-', starting and ending with a letter or digit"
        )
    return name


def default_store_dir() -> Path:
    from ..model.loading import cache_root

    return cache_root() / "chroma"


def make_client(*, path: str | os.PathLike | None = None, url: str | None = None):
    """An embedded client at ``path`` (default store dir) or an HTTP client for ``url``."""
    import chromadb

    settings = chromadb.Settings(anonymized_telemetry=False)
    if url is not None and path is not None:
        raise StoreError("give either a store path or a Chroma server URL, not both")
    if url is None:
        target = Path(path) if path is not None else default_store_dir()
        target.mkdir(parents=True, exist_ok=True)
        return chromadb.PersistentClient(path=str(target), settings=settings)
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise StoreError(f"Chroma URL must look like http://HOST:PORT, got {url!r}")
    port = parsed.port or (443 if parsed.scheme == "https" else 8000)
    try:
        client = chromadb.HttpClient(host=parsed.hostname, port=port, ssl=parsed.scheme == "https", settings=settings)
        client.heartbeat()
    except Exception as exc:  # chromadb raises several transport types
        raise StoreUnavailableError(f"cannot reach the Chroma server at {url}: {exc}") from exc
    return client


@dataclass(frozen=True)
class StoredChunk:
    id: str
    text: str
    source: str
    title: str
    position: int
    tokens: int  # embedder tokens
    score: float | None = None  # cosine similarity to the query, when there was one
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def file(self) -> str:
        return self.metadata.get("file", self.source.split("#")[0])


@dataclass
class IngestReport:
    files: int = 0
    files_changed: int = 0
    files_unchanged: int = 0
    chunks: int = 0  # chunks of the files read, new or not
    chunks_added: int = 0
    chunks_removed: int = 0
    tokens: int = 0  # embedder tokens of the files read
    skipped: list[Skipped] = field(default_factory=list)

    def summary(self) -> str:
        line = (
            f"{self.files} files ({self.files_changed} new or changed, {self.files_unchanged} unchanged), "
            f"{self.chunks} chunks ({self.chunks_added} added, {self.chunks_removed} removed), "
            f"{self.tokens} tokens, {len(self.skipped)} skipped"
        )
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "files_changed": self.files_changed,
            "files_unchanged": self.files_unchanged,
            "chunks": self.chunks,
            "chunks_added": self.chunks_added,
            "chunks_removed": self.chunks_removed,
            "tokens": self.tokens,
            "skipped": [{"source": s.source, "reason": s.reason} for s in self.skipped],
        }


class DocumentStore:
    """One Chroma collection of chunks plus the embedder that made their vectors."""

    def __init__(
        self,
        collection: str,
        *,
        path: str | os.PathLike | None = None,
        url: str | None = None,
        embedder: Embedder | str | None = None,
        client=None,
        create: bool = True,
    ):
        self.name = validate_collection_name(collection)
        self.embedder = embedder if isinstance(embedder, Embedder) else Embedder(embedder or "default")
        self.client = client if client is not None else make_client(path=path, url=url)
        self.location = url or str(path or default_store_dir())
        self.collection = self._open_collection(create)

    @property
    def local_dir(self) -> Path:
        """Where files that go with this store live on this machine: an embedded store's own
        directory, or for a Chroma server a folder named after its URL in the default store directory."""
        if "://" not in str(self.location):
            return Path(self.location)
        return default_store_dir() / "remote" / re.sub(r"\W+", "_", str(self.location))

    def _open_collection(self, create: bool):
        wanted = {"hnsw:space": "cosine", "embedder": self.embedder.model_name}
        names = [c if isinstance(c, str) else c.name for c in self.client.list_collections()]
        self.created = create and self.name not in names  # made by this open: see discard_if_new_and_empty
        if create:
            collection = self.client.get_or_create_collection(self.name, embedding_function=None, metadata=wanted)
        else:
            if self.name not in names:
                raise StoreError(
                    f"no collection {self.name!r} in {self.location}; existing: {', '.join(sorted(names)) or 'none'} "
                    f"(create it with: snapkv-rag ingest PATH --collection {self.name})"
                )
            collection = self.client.get_collection(self.name, embedding_function=None)
        have = (collection.metadata or {}).get("embedder")
        if have is not None and have != self.embedder.model_name:
            raise StoreError(
                f"collection {self.name!r} was embedded with {have!r}, not {self.embedder.model_name!r}; use the same embedder or another collection"
            )
        return collection

    def discard_if_new_and_empty(self) -> bool:
        """Delete the collection if this store created it and it still holds nothing (an ingest
        whose every file was skipped leaves no empty collection behind); whether it did."""
        if not self.created or self.count():
            return False
        self.client.delete_collection(self.name)
        self.created = False
        return True

    # ----------------------------------------------------------------- writing
    def ingest(
        self,
        paths: Iterable[str | os.PathLike],
        *,
        chunk_tokens: int = 200,
        overlap: int = 40,
        text_field: str = "text",
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        progress: bool = False,
        on_skip=None,
        on_file=None,
    ) -> IngestReport:
        """Add or update the files under ``paths``; see the module docstring for the guarantees.

        ``on_skip(skipped)`` hears of each file left out; ``on_file(index, total, path)`` is
        called before each file is read (a progress display).
        """
        from tqdm.auto import tqdm

        report = IngestReport()
        items = list(iter_files(paths))
        bar = tqdm(items, desc="ingest", unit="file", disable=not progress, leave=False)
        for index, item in enumerate(bar):
            if on_file is not None:
                on_file(index, len(items), item.source if isinstance(item, Skipped) else str(item))
            dropped: list[Skipped] = []
            loaded = item if isinstance(item, Skipped) else load_file(item, text_field=text_field, max_bytes=max_file_bytes, dropped=dropped)
            for skipped in [loaded] if isinstance(loaded, Skipped) else dropped:
                report.skipped.append(skipped)
                if on_skip is not None:
                    on_skip(skipped)
            if isinstance(loaded, Skipped):
                continue
            self._ingest_file(str(item), loaded, report, chunk_tokens, overlap)
        return report

    def _ingest_file(self, file: str, docs: list[SourceText], report: IngestReport, chunk_tokens: int, overlap: int) -> None:
        chunks = [c for doc in docs for c in chunk_document(doc, self.embedder.tokenizer, chunk_tokens=chunk_tokens, overlap=overlap)]
        file_hash = text_hash("\x00".join(f"{d.source}\x01{d.text}" for d in docs))
        report.files += 1
        report.chunks += len(chunks)
        report.tokens += sum(c.tokens for c in chunks)
        existing = set(self.collection.get(where={"file": file}, include=[])["ids"])
        wanted = {c.id: c for c in chunks}
        if existing == set(wanted):
            report.files_unchanged += 1
            return
        report.files_changed += 1
        missing = [c for cid, c in wanted.items() if cid not in existing]
        now = time.time()
        step = max(1, min(256, self.client.get_max_batch_size()))
        for i in range(0, len(missing), step):
            batch = missing[i : i + step]
            self.collection.upsert(
                ids=[c.id for c in batch],
                embeddings=self.embedder.embed([c.text for c in batch]),
                documents=[c.text for c in batch],
                metadatas=[self._metadata(c, file, file_hash, len(chunks), now) for c in batch],
            )
        report.chunks_added += len(missing)
        stale = sorted(existing - set(wanted))
        for i in range(0, len(stale), step):
            self.collection.delete(ids=stale[i : i + step])
        report.chunks_removed += len(stale)

    @staticmethod
    def _metadata(chunk: Chunk, file: str, file_hash: str, count: int, now: float) -> dict[str, Any]:
        return {
            "file": file,
            "source": chunk.source,
            "title": chunk.title,
            "position": chunk.position,
            "start": chunk.start,
            "end": chunk.end,
            "tokens": chunk.tokens,
            "content_hash": chunk.content_hash,
            "file_hash": file_hash,
            "chunk_count": count,
            "ingested_at": now,
        }

    def delete_file(self, file: str) -> int:
        ids = self.collection.get(where={"file": str(file)}, include=[])["ids"]
        if ids:
            self.collection.delete(ids=ids)
        return len(ids)

    # ----------------------------------------------------------------- reading
    def count(self) -> int:
        return self.collection.count()

    @staticmethod
    def _chunk(cid: str, text: str, meta: dict[str, Any], score: float | None = None) -> StoredChunk:
        return StoredChunk(
            id=cid,
            text=text,
            source=meta.get("source", ""),
            title=meta.get("title", ""),
            position=int(meta.get("position", 0)),
            tokens=int(meta.get("tokens", 0)),
            score=score,
            metadata=dict(meta),
        )

    @staticmethod
    def _live_versions(metadatas: Sequence[dict[str, Any]]) -> dict[str, str]:
        """file -> the file_hash of its newest complete version."""
        counts: dict[tuple[str, str], int] = defaultdict(int)
        info: dict[tuple[str, str], tuple[int, float]] = {}
        for meta in metadatas:
            key = (meta.get("file", ""), meta.get("file_hash", ""))
            counts[key] += 1
            info[key] = (int(meta.get("chunk_count", 0)), max(float(meta.get("ingested_at", 0.0)), info.get(key, (0, 0.0))[1]))
        live: dict[str, tuple[float, str]] = {}
        for (file, version), n in counts.items():
            expected, stamp = info[(file, version)]
            if n >= expected and (file not in live or stamp > live[file][0]):
                live[file] = (stamp, version)
        return {file: version for file, (_, version) in live.items()}

    def _is_live(self, chunks: list[StoredChunk]) -> list[StoredChunk]:
        files = sorted({c.file for c in chunks})
        if not files:
            return []
        where = {"file": files[0]} if len(files) == 1 else {"file": {"$in": files}}
        metas = self.collection.get(where=where, include=["metadatas"])["metadatas"]
        live = self._live_versions(metas)
        return [c for c in chunks if live.get(c.file) == c.metadata.get("file_hash")]

    def all_chunks(self, where: dict[str, Any] | None = None) -> list[StoredChunk]:
        """Every live chunk, in a stable order (file, then position)."""
        got = self.collection.get(where=where, include=["documents", "metadatas"])
        everything = self.collection.get(include=["metadatas"])["metadatas"] if where else got["metadatas"]
        live = self._live_versions(everything)
        chunks = [
            self._chunk(cid, text, meta)
            for cid, text, meta in zip(got["ids"], got["documents"], got["metadatas"])
            if live.get(meta.get("file")) == meta.get("file_hash")
        ]
        return sorted(chunks, key=lambda c: (c.file, c.source, c.position))

    def search(self, query: str | list[float], n: int, where: dict[str, Any] | None = None) -> list[StoredChunk]:
        """Up to ``n`` live chunks most similar to ``query`` (text or an embedding), best first."""
        total = self.count()
        if total == 0 or n <= 0:
            return []
        vector = self.embedder.embed_query(query) if isinstance(query, str) else list(query)
        # Stale versions may take places in the ranking; ask for a few more than needed.
        got = self.collection.query(
            query_embeddings=[vector],
            n_results=min(total, n + 16),
            where=where,
            include=["documents", "metadatas", "distances"],
        )
        chunks = [
            self._chunk(cid, text, meta, 1.0 - float(dist))
            for cid, text, meta, dist in zip(got["ids"][0], got["documents"][0], got["metadatas"][0], got["distances"][0])
        ]
        return self._is_live(chunks)[:n]

    def files(self) -> list[dict[str, Any]]:
        """One summary per live file: path, title, chunks, tokens."""
        out: dict[str, dict[str, Any]] = {}
        for chunk in self.all_chunks():
            entry = out.setdefault(chunk.file, {"file": chunk.file, "title": chunk.title, "chunks": 0, "tokens": 0})
            entry["chunks"] += 1
            entry["tokens"] += chunk.tokens
        return list(out.values())

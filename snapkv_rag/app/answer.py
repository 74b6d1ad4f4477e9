"""Answering a question: one run per side (full cache and the chosen policy), each through DocumentQA."""

from __future__ import annotations

import time

import streamlit as st

from snapkv_rag import Engine
from snapkv_rag.integrations import DocumentQA, DocumentStore, kept_per_document, recording_kept_indices, small_model_note

from ..errors import SnapKVRagError
from .config import MAX_QUESTION_CHARS, Settings, checked_policy, reads_past_window
from .views import Run, Turn, md_escape, render_comparison, render_kept, render_run_caption, render_sources, streamed_markdown


def ask_one(qa: DocumentQA, question: str, run: Run, settings: Settings, policy, target) -> None:
    """Stream one answer into ``target`` and fill ``run`` (answer, time to first token, kept entries)."""
    started = time.perf_counter()
    with target:
        with st.spinner(f"{run.label}: retrieving and reading the documents…"):
            with recording_kept_indices() as kept:
                stream = qa.stream(question, compression=policy, max_new_tokens=settings.max_new_tokens, **settings.sampling())

        def pieces():
            for piece in stream:
                if run.ttft is None:
                    run.ttft = time.perf_counter() - started
                yield piece

        try:
            written = st.write_stream(streamed_markdown(pieces()))
        finally:
            stream.close()
        text = written if isinstance(written, str) else "".join(map(str, written))
        if not text.strip():
            st.markdown("_(the model returned an empty answer)_")
    run.answer = stream.answer
    record = kept[-1] if kept else None
    if policy is not None and record is not None:
        try:
            run.kept = kept_per_document(qa.engine.tokenizer, stream.context, record)
        except ValueError as exc:  # a chat template that rewrites the documents
            run.kept_note = f"Per-document kept entries are not available: {exc}"
        prompt = run.answer.result.usage.prompt_tokens
        if settings.budget >= prompt:
            run.kept_note = (
                f"The budget ({settings.budget:,}) is at least the prompt ({prompt:,} tokens), so nothing was "
                "compressed; lower the budget or stuff more context to see compression at work."
            )


def answer_question(question: str, engine: Engine | None, engine_error: str | None, store: DocumentStore | None, settings: Settings, collection: str) -> Turn:
    turn = Turn(question, settings=settings)
    with st.chat_message("user"):
        st.markdown(md_escape(question))
    with st.chat_message("assistant"):
        problem = None
        if engine is None:
            problem = engine_error or "No model is loaded."
        elif not question.strip():
            problem = "The question is empty."
        elif len(question) > MAX_QUESTION_CHARS:
            problem = f"The question is {len(question):,} characters long; keep it under {MAX_QUESTION_CHARS:,} (put long text into a document instead)."
        elif store is None or store.count() == 0:
            problem = f"There are no documents in {collection or 'this collection'} yet. Add files or a folder in the Documents panel above, then ask again."
        policy = None
        if problem is None:
            try:
                policy = checked_policy(settings, engine)
            except SnapKVRagError as exc:
                problem = f"Fix the compression settings in the sidebar: {exc}"
        if problem:
            st.error(problem)
            turn.error = problem
            return turn
        turn.model_note = small_model_note(engine, "For better answers start the app with a larger instruct model: `snapkv-rag app --model PATH_OR_HUB_ID`.")
        assert store is not None  # a missing or empty store was refused above
        # the chosen policy decides the stuffing: a sparse one may stuff past the window (rolling prefill)
        qa = DocumentQA(
            engine, store, compression=policy, context_tokens=settings.context_tokens, max_new_tokens=settings.max_new_tokens, kv_reuse=settings.kv_reuse
        )
        past_window = reads_past_window(settings, engine, policy)
        runs = [Run("Full cache", "full")] if settings.side_by_side and not past_window else []
        runs.append(Run(settings.label, settings.method))
        targets = st.columns(2, gap="large") if len(runs) == 2 else [st.container()]
        try:
            for run, target in zip(runs, targets):
                if len(runs) == 2:
                    target.markdown(f"##### {run.label}")
                ask_one(qa, question, run, settings, policy if run is runs[-1] else None, target)
                with target:
                    render_sources(run.done)
        except Exception as exc:  # say so in the page, keep the app running and every answer already made
            turn.error = str(exc) if isinstance(exc, SnapKVRagError) else f"Answering failed: {type(exc).__name__}: {exc}"
            turn.runs = [r for r in runs if r.answer is not None]
            failed = runs[len(turn.runs)].label if 0 < len(turn.runs) < len(runs) else None
            st.error(f"{failed}: {turn.error}" if failed else turn.error)
            return turn
        turn.runs = runs
        if len(runs) == 2:
            render_comparison(*runs)
        else:
            render_run_caption(runs[0])
        if turn.model_note:
            st.caption(turn.model_note)
        if runs[-1].method != "full":
            render_kept(runs[-1])
        if runs[-1].kept is not None:
            st.session_state["last_kept"] = [(d.number, d.tokens, d.kept) for d in runs[-1].kept]
    return turn

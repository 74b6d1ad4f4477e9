"""How one answer is shown: formatting helpers, the stats table, sources, the side-by-side comparison and the kept-entries chart."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from snapkv_rag.integrations import Answer, DocumentKept, citation_prf

from .config import COLORS, Settings


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float | None) -> str:
    return "–" if s is None else (f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s")


# Where GFM would autolink (Streamlit's markdown does): after "http(s):/" before the second "/",
# after "www" before ".", after "@" before a domain. A backslash escape would not do (remark-gfm looks
# for links in the text after escapes and character references are decoded); an invisible word joiner
# breaks the pattern. It sits before the pattern's last character, so a streamed answer can be escaped as it grows.
_AUTOLINK = re.compile(r"(?i)(?:(?<=https:/)|(?<=http:/))(?=/)|(?<=www)(?=\.)|(?<=@)(?=[-\w])")
WORD_JOINER = "\u2060"


def no_autolink(text: str) -> str:
    """Text in which no bare URL, ``www.`` address or e-mail address becomes a link."""
    return _AUTOLINK.sub(WORD_JOINER, text)


def md_escape(text: str) -> str:
    """Show text as written: no markdown, HTML, LaTeX or link (not even a bare URL) interpretation."""
    text = re.sub(r"([\\`*_{}\[\]<>#|$~&])", r"\\\1", no_autolink(text))
    # List markers and numbered-list starts only matter at the start of a line.
    text = re.sub(r"(?m)^(\s*)([-+])(\s)", r"\1\\\2\3", text)
    return re.sub(r"(?m)^(\s*)(\d+)\.(\s)", r"\1\2\\.\3", text)


def answer_markdown(text: str) -> str:
    """Model text as markdown (emphasis and lists render), with ``$`` kept literal (no LaTeX) and
    no link, image or tag: an answer repeats its documents, and a document must not plant a
    tracking pixel or an exfiltration link in it. Brackets (``[1]``), angle brackets, bare URLs,
    character references (``&#58;``) and the backslash that could undo those escapes are shown as written."""
    return re.sub(r"([\\\[\]<>$&])", r"\\\1", no_autolink(text))


def streamed_markdown(pieces: Iterable[str]) -> Iterator[str]:
    """:func:`answer_markdown` of a streamed answer, piece by piece: what is yielded adds up to the
    whole answer's markdown (a URL split across pieces is broken as in the whole text)."""
    text, shown = "", ""
    for piece in pieces:
        text += piece
        markdown = answer_markdown(text)
        yield markdown[len(shown) :]
        shown = markdown


def md_code(text: str) -> str:
    """``text`` as inline code (no markdown, no link), however many backticks or line breaks it holds."""
    text = " ".join(text.splitlines())  # a blank line would end the code span
    fence = "`" * (max(map(len, re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def source_label(number: int, chunk) -> str:
    """A source's expander label, ``[n] title · file · chunk k``, its document parts escaped."""
    name = Path(chunk.file).name
    title = chunk.title if chunk.title and chunk.title != Path(name).stem else ""
    return md_escape(f"[{number}] {short(title, 40) + ' · ' if title else ''}{name} · chunk {chunk.position + 1}")


def short(text: str, width: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def cited_numbers(answer: Answer) -> list[int]:
    return [n for n, _ in answer.sources]


def routes_of(answer: Answer) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for c in answer.citations:
        out.setdefault(c.number, []).append(c)
    return out


@dataclass
class Run:
    label: str
    method: str
    answer: Answer | None = None
    ttft: float | None = None  # seconds from the call to the first text piece
    kept: list[DocumentKept] | None = None  # per stuffed document; None when nothing was recorded
    kept_note: str | None = None

    @property
    def done(self) -> Answer:
        """The finished answer: the views render only runs that finished."""
        if self.answer is None:
            raise RuntimeError(f"{self.label}: the run has not finished")
        return self.answer


@dataclass
class Turn:
    question: str
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    settings: Settings | None = None
    model_note: str | None = None  # what to expect of a small model, shown under its answers


def stats_row(run: Run) -> dict[str, str]:
    a = run.done
    s = a.result.stats
    kept = max(s.kept_tokens_per_layer) if s.kept_tokens_per_layer else 0
    row = {
        "Prefill": fmt_seconds(s.prefill_seconds),
        "Time to first token": fmt_seconds(run.ttft),
        "Decode": "–" if s.decode_ms_per_token is None else f"{s.decode_ms_per_token:.0f} ms/token",
        "KV cache kept / full": f"{fmt_bytes(s.prompt_kv_bytes_kept)} / {fmt_bytes(s.prompt_kv_bytes_full)} ({s.compression_ratio_text}×)",
        "Prompt entries kept per layer": f"{kept:,} / {s.prompt_tokens_padded:,}",
        "Documents stuffed": f"{len(a.context.chunks)} ({a.context.document_tokens:,} tokens)",
        "Sources cited": " ".join(f"[{n}]" for n in cited_numbers(a)) or "none",
    }
    reused = reused_prompt_tokens(s)
    if reused is not None:
        row["Prompt tokens reused"] = f"{reused:,}"
    if getattr(s, "segment_reuse", None) == "blended":
        row["Document K/V"] = f"{s.segment_hits} stored, {s.segment_misses} computed now, {s.recomputed_prompt_tokens:,} tokens recomputed"
    return row


def reused_prompt_tokens(stats) -> int | None:
    """Prompt tokens served from a cache (prefix or stored document K/V), when the engine reports them."""
    value = getattr(stats, "reused_prompt_tokens", None)
    if value is None:
        value = (getattr(stats, "extra", None) or {}).get("reused_prompt_tokens")
    return None if value is None else int(value)


def render_unsupported(answer: Answer) -> None:
    for s in {(s.sentence, s.missing): s for s in answer.unsupported}.values():  # a repeated sentence once
        facts = ", ".join(md_escape(f) for f in s.missing)
        if s.supported:
            st.warning(f"Partly supported: “{md_escape(s.sentence)}” — no stuffed document contains {facts}.", icon=":material/warning:")
        else:
            st.warning(f"Not supported by the stuffed documents: “{md_escape(s.sentence)}” — no stuffed document contains {facts}.", icon=":material/block:")


def render_sources(answer: Answer) -> None:
    sources = answer.sources
    render_unsupported(answer)
    if not sources:
        st.caption("No document supports this answer (no citation by the model, no matching evidence).")
        return
    st.markdown("**Sources**")
    routes = routes_of(answer)
    for number, chunk in sources:
        with st.expander(source_label(number, chunk)):
            cites = routes[number]
            how = ["cited by the model"] if any(c.route == "generated" for c in cites) else []
            scores = [c.score for c in cites if c.route == "attributed" and c.score is not None]
            if scores:
                sentences = f", {len(scores)} sentences" if len(scores) > 1 else ""
                how.append(f"matched by evidence (score {max(scores):.2f}{sentences})")
            if chunk.score is not None:
                how.append(f"retrieval similarity {chunk.score:.2f}")
            st.caption(" · ".join(how))
            supported = [c.sentence for c in cites if c.sentence]
            if supported:
                st.markdown("Supports: " + " ".join(f"“{md_escape(s)}”" for s in dict.fromkeys(supported)))
            with st.container(border=True):
                st.markdown(md_escape(chunk.text))
            st.caption(f"File: {md_code(chunk.file)}")
    if answer.invalid_citations:
        st.caption("The model also cited documents that were not in the prompt: " + " ".join(f"[{n}]" for n in answer.invalid_citations))


def render_run_caption(run: Run) -> None:
    row = stats_row(run)
    parts = [run.label, f"prefill {row['Prefill']}", f"first token {row['Time to first token']}", row["Decode"], f"KV {row['KV cache kept / full']}"]
    if "Prompt tokens reused" in row:
        parts.append(f"{row['Prompt tokens reused']} prompt tokens reused")
    parts.append(f"{row['Documents stuffed'].replace(' (', ' documents (', 1)} stuffed")
    st.caption(" · ".join(parts))


def render_comparison(full: Run, other: Run) -> None:
    a, b = full.done, other.done
    f1 = citation_prf(cited_numbers(b), cited_numbers(a))[2]
    sa, sb = a.result.stats, b.result.stats
    c1, c2, c3, c4 = st.columns(4)
    c1.metric(
        "Citation agreement F1", f"{f1:.2f}", help="F1 of the compressed answer's sources against the full-cache answer's sources (both empty counts as 1)."
    )
    c2.metric("Same answer text", "yes" if a.text.strip() == b.text.strip() else "no")
    c3.metric("KV cache kept", f"{sb.prompt_kv_bytes_kept / sb.prompt_kv_bytes_full:.0%}" if sb.prompt_kv_bytes_full else "–")
    c4.metric(
        "Decode speed vs full",
        decode_speedup(sa, sb),
        help="Full-cache ms/token over compressed ms/token (medians of one run each), with the range their step-time "
        "quartiles allow; 'no clear difference' when that range holds 1×, n/a when nothing was evicted.",
    )
    rows = {full.label: stats_row(full), other.label: stats_row(other)}
    st.table(pd.DataFrame(rows))


def decode_speedup(full, compressed) -> str:
    """The compressed run's decode speed-up over the full cache, only where one run can show one."""
    if compressed.prompt_kv_bytes_kept >= compressed.prompt_kv_bytes_full:
        return "n/a (nothing evicted)"
    if not full.decode_ms_per_token or not compressed.decode_ms_per_token:
        return "–"
    if full.decode_ms_quartiles is None or compressed.decode_ms_quartiles is None:
        return "n/a (too few tokens to time)"
    (f1, f3), (c1, c3) = full.decode_ms_quartiles, compressed.decode_ms_quartiles
    low, high = f1 / c3, f3 / c1
    if low <= 1.0 <= high:
        return f"no clear difference ({low:.2f}–{high:.2f}×)"
    return f"{full.decode_ms_per_token / compressed.decode_ms_per_token:.2f}× ({low:.2f}–{high:.2f}×)"


def kept_chart(run: Run) -> alt.Chart:
    answer = run.done
    cited = set(cited_numbers(answer))
    rows, labels = [], []
    for doc in run.kept or []:
        chunk = answer.context.chunks[doc.number - 1]
        label = f"[{doc.number}] {short(chunk.title or Path(chunk.file).stem, 34)}"
        labels.append(label)
        part = "kept (cited)" if doc.number in cited else "kept"
        common = {"document": label, "tokens": doc.tokens, "kept entries": round(doc.kept, 1), "kept share": f"{doc.share:.0%}"}
        rows.append({**common, "part": part, "entries": doc.kept, "order": 0})
        rows.append({**common, "part": "dropped", "entries": doc.tokens - doc.kept, "order": 1})
    data = pd.DataFrame(rows)
    y = alt.Y("document:N", sort=labels, title=None, axis=alt.Axis(labelLimit=260))
    bars = (
        alt.Chart(data)
        .mark_bar()
        .encode(
            y=y,
            x=alt.X("sum(entries):Q", title="KV entries of the document (average over layers and KV heads)", axis=alt.Axis(tickCount=8)),
            color=alt.Color(
                "part:N",
                scale=alt.Scale(domain=list(COLORS), range=list(COLORS.values())),
                legend=alt.Legend(title=None, orient="top"),
            ),
            order=alt.Order("order:Q"),
            tooltip=["document", "tokens", "kept entries", "kept share"],
        )
    )
    share = pd.DataFrame([{"document": r["document"], "tokens": r["tokens"], "kept share": r["kept share"]} for r in rows[::2]])
    text = alt.Chart(share).mark_text(align="left", dx=4, color="#333").encode(y=y, x="tokens:Q", text="kept share:N")
    return (bars + text).properties(height=alt.Step(26))


def render_kept(run: Run) -> None:
    if run.kept_note:
        st.info(run.kept_note)
    if not run.kept:
        return
    answer = run.done
    stats = answer.result.stats
    n = stats.prompt_tokens_padded
    kept_total = max(stats.kept_tokens_per_layer) if stats.kept_tokens_per_layer else n
    docs_kept = sum(d.kept for d in run.kept)
    docs_tokens = answer.context.document_tokens  # the count "Documents stuffed" shows (blocks and their separators)
    rest_tokens = n - docs_tokens
    st.markdown(f"**What {run.label.split(' @')[0]} kept of each stuffed document**")
    st.altair_chart(kept_chart(run), width="stretch")
    st.caption(
        f"Each bar is one numbered document of the prompt (its tokens); the coloured part is the KV entries kept of it, "
        f"averaged over the model's layers and KV heads; cited documents are red. Kept {kept_total:,} of {n:,} prompt "
        f"entries per layer and head: {docs_kept:,.0f} of {docs_tokens:,} document tokens, and {kept_total - docs_kept:,.0f} "
        f"of the {rest_tokens:,} tokens of instructions, question and template."
    )


def render_turn(turn: Turn, *, last: bool) -> None:
    with st.chat_message("user"):
        st.markdown(md_escape(turn.question))
    with st.chat_message("assistant"):
        if turn.error:
            for run in turn.runs:  # answers finished before the failure stay on the page
                st.markdown(f"##### {run.label}")
                st.markdown(answer_markdown(run.done.text) or "_(empty answer)_")
                render_sources(run.done)
            st.error(turn.error)
            return
        if len(turn.runs) == 2:
            cols = st.columns(2, gap="large")
            for col, run in zip(cols, turn.runs):
                with col:
                    st.markdown(f"##### {run.label}")
                    st.markdown(answer_markdown(run.done.text) or "_(empty answer)_")
                    render_sources(run.done)
            render_comparison(*turn.runs)
        else:
            run = turn.runs[0]
            st.markdown(answer_markdown(run.done.text) or "_(empty answer)_")
            render_sources(run.done)
            render_run_caption(run)
        if turn.model_note:
            st.caption(turn.model_note)
        compressed = turn.runs[-1]
        if last and compressed.method != "full":
            render_kept(compressed)

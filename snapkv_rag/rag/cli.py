"""``snapkv-rag ingest`` and ``snapkv-rag ask``."""

from __future__ import annotations

import json
import sys
from typing import Any

from ..cli_common import add_store_args, open_store
from ..engine.results import kept_tokens_text
from ..errors import SnapKVRagError
from ..model.adapter_rule import AUTO_DOCUMENTS


def _add_kv_args(p) -> None:
    p.add_argument("--kv-dir", default=None, help="where chunk K/V are stored (default: STORE/kv-segments, or the cache directory for a Chroma server)")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="bound of the chunk K/V directory (default 2 GiB; least recently used first)")


def add_rag_parsers(sub, add_model_args, add_generation_args) -> None:
    ingest = sub.add_parser("ingest", help="add files and folders to a Chroma collection (idempotent)")
    ingest.add_argument("paths", nargs="+", help="files or folders (.txt .md .html .pdf .json .jsonl)")
    add_store_args(ingest)
    ingest.add_argument("--chunk-tokens", type=int, default=200, help="chunk size in embedder tokens")
    ingest.add_argument("--overlap", type=int, default=40, help="tokens shared by consecutive chunks")
    ingest.add_argument("--text-field", default="text", help="the text field of .json/.jsonl records")
    ingest.add_argument("--max-file-mb", type=float, default=50.0, help="skip larger files")
    ingest.add_argument("--no-progress", action="store_true")
    ingest.add_argument(
        "--precompute-kv", action="store_true", help="also compute every chunk's K/V for --kv-reuse chunks now (else on first use); takes the model options"
    )
    _add_kv_args(ingest)
    add_model_args(ingest)
    ingest.set_defaults(func=cmd_ingest)

    ask = sub.add_parser("ask", help="answer a question over a collection, with numbered sources")
    ask.add_argument("question")
    add_store_args(ask)
    ask.add_argument(
        "--context-tokens",
        type=int,
        default=None,
        help="LLM tokens of documents to stuff (default: the model's recommended amount, 1000 for the embedded model; else all that fit)",
    )
    ask.add_argument("--top-k", type=int, default=None, help="at most this many chunks")
    ask.add_argument("--min-score", type=float, default=None, help="drop chunks with lower cosine similarity")
    ask.add_argument(
        "--order",
        choices=("score", "source", "cache"),
        default="score",
        help="document order in the prompt (cache: the score-ranked chunks that opened a recent prompt first, for prefix reuse)",
    )
    ask.add_argument("--whole-collection", action="store_true", help="stuff every chunk in source order (same prefix for every question)")
    ask.add_argument(
        "--kv-reuse",
        choices=("chunks", "prefix", "off"),
        default=None,
        help=(
            "reuse stored chunk K/V at any position, only an identical prompt prefix, or nothing "
            "(default: the model's recommendation: chunks, but prefix for the embedded 135M model)"
        ),
    )
    ask.add_argument("--recompute", type=float, default=None, help="share of reused chunk tokens computed again (default 0.15; 1.0 equals a full prefill)")
    ask.add_argument(
        "--skim-tokens",
        type=int,
        default=None,
        help=(
            "skim, then read: retrieve this many tokens, read them once compressed (rolled past the window), "
            "and answer from the documents the question's attention ranked best, stuffed into --context-tokens (default: off)"
        ),
    )
    ask.add_argument(
        "--skim-stored",
        action="store_true",
        help="skim from each chunk's stored K/V (--kv-dir; computed by ingest --precompute-kv or on first use): only the question is read",
    )
    _add_kv_args(ask)
    add_model_args(ask, adapter_default=AUTO_DOCUMENTS)
    add_generation_args(ask)
    ask.set_defaults(func=cmd_ask, compression="default")


class MissingPathError(SnapKVRagError, FileNotFoundError):
    """A path named on the command line does not exist."""


def cmd_ingest(args) -> int:
    from pathlib import Path

    from tqdm.auto import tqdm

    from .chunking import ChunkingError, chunk_document  # noqa: F401 (validate sizes before loading models)

    if args.chunk_tokens < 8 or not 0 <= args.overlap < args.chunk_tokens // 2:
        raise ChunkingError(f"need --chunk-tokens >= 8 and 0 <= --overlap < chunk-tokens/2, got {args.chunk_tokens}/{args.overlap}")
    missing = [p for p in args.paths if not Path(p).expanduser().exists()]
    if missing:
        # Checked before anything is read or written: a typo in a script must not pass as a partial ingest.
        raise MissingPathError(f"no such file or folder: {', '.join(missing)} (nothing was ingested)")
    store = open_store(args)
    report = store.ingest(
        args.paths,
        chunk_tokens=args.chunk_tokens,
        overlap=args.overlap,
        text_field=args.text_field,
        max_file_bytes=int(args.max_file_mb * 2**20),
        progress=not args.no_progress and not args.json,
        # tqdm.write prints above the progress bar instead of into it.
        on_skip=None if args.json else (lambda s: tqdm.write(f"snapkv-rag: {s}", file=sys.stderr)),
    )
    if store.discard_if_new_and_empty():
        if args.json:
            print(json.dumps({**report.to_dict(), "collection": None, "store": store.location, "total_chunks": 0}))
        else:
            print(f"{store.name}: {report.summary()}; nothing was ingested, so no collection was created")
        return 1
    kv = _precompute_kv(args, store) if args.precompute_kv else None
    if args.json:
        print(json.dumps({**report.to_dict(), "collection": store.name, "store": store.location, "total_chunks": store.count(), **(kv or {})}))
    else:
        print(f"{store.name}: {report.summary()}; the collection holds {store.count()} chunks")
        if kv:
            print(f"chunk K/V: {kv['kv_computed']} computed, {kv['kv_already_stored']} already stored, in {kv['kv_dir']}")
    return 0 if report.files or not report.skipped else 1


def _precompute_kv(args, store) -> dict[str, Any]:
    from ..cli_common import load_engine
    from .kv_reuse import chunk_kv_store, precompute_chunk_kv

    kv_store = chunk_kv_store(store, args.kv_dir, args.kv_cache_bytes)
    computed, stored = precompute_chunk_kv(load_engine(args), store.all_chunks(), kv_store, progress=not args.no_progress and not args.json)
    return {"kv_computed": computed, "kv_already_stored": stored, "kv_dir": str(kv_store.directory)}


def _qa_kwargs(args) -> tuple[dict[str, Any], dict[str, Any]]:
    from ..compression import as_policy
    from ..engine.sampling import GenerationParams

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.prompt_lookup_num_tokens is not None:  # else DocumentQA's default
        sampling["prompt_lookup_num_tokens"] = args.prompt_lookup_num_tokens
    GenerationParams.build(**sampling)
    compression = {"compression": as_policy(args.compression)}  # "default": DocumentQA's, the one default
    return sampling, compression


def _describe(answer) -> list[str]:
    lines = ["", "Sources:"]
    routes: dict[int, list[str]] = {}  # each route once per document, however many sentences it supports
    for c in answer.citations:
        if c.route not in routes.setdefault(c.number, []):
            routes[c.number].append(c.route)
    for number, chunk in answer.sources:
        sim = f", similarity {chunk.score:.2f}" if chunk.score is not None else ""
        lines.append(f"  [{number}] {chunk.title} - {chunk.source} (chunk {chunk.position + 1}{sim}; {', '.join(routes[number])})")
    if not answer.sources:
        lines.append("  (no document supports the answer)")
    for s in {(s.sentence, s.missing): s for s in answer.unsupported}.values():  # a repeated sentence once
        how = "partly supported" if s.supported else "NOT SUPPORTED by the stuffed documents"
        lines.append(f'  {how}: "{s.sentence}" (no stuffed document contains {", ".join(s.missing)})')
    if answer.invalid_citations:
        lines.append(f"  invalid citations: {answer.invalid_citations}")
    ctx, stats = answer.context, answer.result.stats
    dropped = f", {ctx.duplicates} duplicates dropped" if ctx.duplicates else ""
    lines.append(
        f"Stuffed {len(ctx.chunks)} chunks, {ctx.document_tokens} of {ctx.budget_tokens} tokens ({ctx.left_out} candidates left out{dropped}); "
        f"prompt {answer.result.usage.prompt_tokens} tokens, KV kept {kept_tokens_text(stats.kept_tokens_per_layer)} per layer "
        f"({stats.compression['method'] if stats.compression else 'full cache'}, {stats.compression_ratio_text}x); "
        f"prefill {stats.prefill_seconds:.1f} s{_reuse_note(stats, answer.result.usage.prompt_tokens)}{_rolling_note(stats)}"
        + (f", decode {stats.decode_ms_per_token:.0f} ms/token{_drafts_note(stats)}" if stats.decode_ms_per_token else "")
    )
    skim = ctx.settings.get("skim")
    if skim:
        how = "read compressed"
        if skim.get("from") == "stored keys":
            how = f"{skim['reused_tokens']} from stored keys, {skim['chunks_computed']} chunks computed now"
        read = f"{skim['skimmed_prompt_tokens']} prompt tokens, {how}"
        lines.append(f"Skimmed {skim['skimmed_documents']} chunks ({read}) in {skim['skim_seconds']:.1f} s to choose them")
    return lines


def _drafts_note(stats) -> str:
    per_forward = (stats.drafts or {}).get("tokens_per_forward")
    return f" ({per_forward:.1f} tokens per forward with prompt-lookup drafts)" if per_forward else ""


def _rolling_note(stats) -> str:
    chunks = stats.policy_stats.get("rolled_chunks")
    if not chunks:
        return ""
    rolling = (stats.compression or {}).get("rolling")
    return f" (past the window: read in {chunks} chunks of {rolling} tokens, at most {stats.policy_stats['rolling_peak_entries']} entries per layer at once)"


def _reuse_note(stats, prompt_tokens: int) -> str:
    if stats.segment_reuse == "blended":
        return (
            f" ({stats.reused_prompt_tokens} of {prompt_tokens} prompt tokens reused from stored chunk K/V, "
            f"{stats.recomputed_prompt_tokens} recomputed; {stats.segment_hits} chunks found, {stats.segment_misses} computed now)"
        )
    if stats.segment_reuse:
        return f" (chunk K/V reuse not applied: {stats.segment_reuse})"
    if stats.reused_prompt_tokens:
        return f" ({stats.reused_prompt_tokens} of {prompt_tokens} prompt tokens reused from the prefix cache)"
    return ""


def cmd_ask(args) -> int:
    from ..cli_common import load_engine
    from ..compression.less.collection_kernels import calibration_note
    from .kv_reuse import kv_reuse_note
    from .qa import DocumentQA, small_model_note

    sampling, compression = _qa_kwargs(args)
    store = open_store(args, create=False)
    if store.count() == 0:  # said before the model loads (seconds)
        from .stuffing import EmptyCollectionError

        raise EmptyCollectionError.named(store.name)
    qa = DocumentQA(
        load_engine(args),
        store,
        context_tokens=args.context_tokens,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        min_score=args.min_score,
        order=args.order,
        whole_collection=args.whole_collection,
        kv_reuse=args.kv_reuse,
        kv_dir=args.kv_dir,
        kv_cache_bytes=args.kv_cache_bytes,
        recompute=args.recompute,
        skim_tokens=args.skim_tokens,
        skim_stored=args.skim_stored,
        **compression,
    )
    sampling.pop("max_new_tokens")
    if args.json:
        print(json.dumps(qa.ask(args.question, **sampling).to_dict(), indent=2))
        return 0
    stream = qa.stream(args.question, **sampling)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    print("\n".join(_describe(stream.answer)))
    notes = [
        calibration_note(qa.compression, qa.policy()),
        kv_reuse_note(qa.engine, args.kv_reuse),
        small_model_note(qa.engine, "--model PATH_OR_HUB_ID takes a larger instruct model."),
    ]
    for note in filter(None, notes):
        print(f"note: {note}", file=sys.stderr)
    return 0

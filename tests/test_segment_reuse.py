"""Segment (chunk) K/V reuse: RoPE moves, blended prefill, the on-disk store, the engine API (issue 24).

Tolerance: with ``recompute=1.0`` the blended prefill computes every token, but through a
4-D mask over a cache filled in position order rather than SDPA's causal path, so
next-token logits match a plain prefill within 1e-4 (fp32 tiny models); kept indices and
greedy tokens must be identical.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from conftest import FAMILIES, build_tokenizer, gemma3_engine, tiny_engine

from snapkv_rag.compression import H2O, SnapKV, StreamingLLM
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.preparation import prepare_request
from snapkv_rag.errors import InvalidGenerationParameterError
from snapkv_rag.reuse.blending import (
    RopeShift,
    SegmentReuseUnsupported,
    compute_segment,
    layer_kv,
    model_rope_shift,
    segment_token_spans,
)
from snapkv_rag.reuse.segment_store import SegmentKV, SegmentKVStore

DOCS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. " * 2,
    "Numbers like 1234 and 5678 appear in passkeys. Hello world, hello engine! " * 2,
    "Long documents need compressed caches; SnapKV keeps what the question looks at. " * 2,
]
QUESTION = "Question: what is the passkey?"
ATOL = 1e-4


def prompt_for(order):
    return "Documents:\n\n" + "\n\n".join(f"[{i + 1}]\n{DOCS[j]}" for i, j in enumerate(order)) + f"\n\n{QUESTION}"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def prefill(engine, prompt, policy, **reuse):
    request = prepare_request(engine, [prompt], policy, None, dict(max_new_tokens=2, **reuse), [QUESTION])
    assert (request.segments is not None) == bool(reuse.get("reuse_segments")), request.segment_note
    run = DecodeRun(engine.model, request.rows, request.params, request.row_policies, engine._pad_id, segments=request.segments)
    next(run.steps())
    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_shifted_layer0_keys_equal_keys_computed_at_the_offset(family, tok):
    engine = tiny_engine(family, tok)
    shift = engine.rope_shift()
    ids = torch.tensor([engine.tokenizer(DOCS[0])["input_ids"][:20]])
    at_zero = layer_kv(engine.model, ids, torch.arange(20)[None], layers=1)[0][0]
    at_100 = layer_kv(engine.model, ids, torch.arange(100, 120)[None], layers=1)[0][0]
    torch.testing.assert_close(shift(at_zero, 100), at_100, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shift(at_100, -100), at_zero, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "policy",
    [None, SnapKV(window_size=8, max_capacity_prompt=40, kernel_size=3), SnapKV(window_size="question", max_capacity_prompt=40, min_window=4, max_window=16)],
    ids=["full", "snapkv", "snapkv-question"],
)
def test_recompute_everything_equals_a_full_prefill(family, policy, tok):
    engine = tiny_engine(family, tok)
    store = SegmentKVStore()
    prompt = prompt_for([2, 0, 1])
    prefill(engine, prompt_for([0, 1, 2]), policy, reuse_segments=DOCS, segment_store=store)  # store the segments
    blended = prefill(engine, prompt, policy, reuse_segments=DOCS, segment_store=store, recompute=1.0)
    plain = prefill(engine, prompt, policy)
    assert blended.segment_hits == 3 and blended.segment_misses == 0
    assert blended.reused_tokens == [0] and blended.recomputed_tokens > 0
    torch.testing.assert_close(blended.last_logits, plain.last_logits, atol=ATOL, rtol=ATOL)
    assert blended.kept_tokens_per_layer == plain.kept_tokens_per_layer
    if policy is not None:
        for layer, indices in plain.session.kept_indices.items():
            assert torch.equal(blended.session.kept_indices[layer], indices), f"layer {layer}"


def test_partial_reuse_counts_and_gets_closer_as_more_is_recomputed(tok):
    engine = tiny_engine("llama", tok)
    store = SegmentKVStore()
    prompt = prompt_for([1, 2, 0])
    first = prefill(engine, prompt_for([0, 1, 2]), None, reuse_segments=DOCS, segment_store=store)
    assert (first.segment_hits, first.segment_misses) == (0, 3)
    plain = prefill(engine, prompt, None)
    n = len(plain.rows[0])
    errors = []
    for ratio in (0.0, 0.5, 1.0):
        run = prefill(engine, prompt, None, reuse_segments=DOCS, segment_store=store, recompute=ratio)
        covered = sum(e - s for s, e in run.segments.spans)
        # the question tail lies outside every span: all it computes is fresh, none of it reused
        assert run.recomputed_tokens == round(ratio * covered)
        assert run.reused_tokens[0] == covered - run.recomputed_tokens < n
        errors.append(float((run.last_logits - plain.last_logits).abs().max()))
    assert errors[2] < ATOL < errors[0]
    assert errors[1] <= errors[0]


def test_spans_leave_out_tokens_that_straddle_a_boundary(tok):
    text = "The quick brown fox jumps over the lazy dog."
    segment = "fox jumps over"  # " fox" carries the space before it: it straddles the start
    encoded = tok(text, return_offsets_mapping=True)
    ((start, end),) = segment_token_spans(encoded["offset_mapping"], text, [segment])
    inside = tok.decode(encoded["input_ids"][start:end])
    assert inside.strip() and inside in segment and not inside.startswith(" fox")
    assert segment_token_spans(encoded["offset_mapping"], text, ["not in the text", ""]) == []
    # a shift (a BOS added in front after tokenizing) moves every span
    assert segment_token_spans(encoded["offset_mapping"], text, [segment], shift=1) == [(start + 1, end + 1)]


def test_models_that_cannot_move_keys_are_refused(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128)).eval()
    with pytest.raises(SegmentReuseUnsupported, match="rotary"):
        RopeShift(gpt2)
    engine = gemma3_engine(tok, sliding_window=16)
    with pytest.raises(SegmentReuseUnsupported, match="sliding"):
        model_rope_shift(engine.model)
    assert model_rope_shift(engine.model, sliding=True).layer_types == ["sliding_attention", "full_attention"]  # a rolling prefill moves them
    result = engine.generate(prompt_for([0, 1, 2]), max_new_tokens=2, reuse_segments=DOCS)
    assert result.stats.segment_reuse.startswith("refused: sliding") and result.stats.reused_prompt_tokens == 0


def test_policies_needing_every_query_prefill_whole(tok):
    engine = tiny_engine("llama", tok)
    result = engine.generate(prompt_for([0, 1, 2]), compression=H2O(max_capacity_prompt=24, recent=8), max_new_tokens=2, reuse_segments=DOCS)
    assert "every prompt query" in result.stats.segment_reuse
    streaming = engine.generate(
        prompt_for([0, 1, 2]), compression=StreamingLLM(sink_tokens=4, max_capacity_prompt=24), max_new_tokens=2, reuse_segments=DOCS, prefix_cache=False
    )
    assert streaming.stats.segment_reuse == "blended"


def test_stats_on_the_public_api(tok):
    engine = tiny_engine("llama", tok)
    store = SegmentKVStore()
    first = engine.generate(prompt_for([0, 1, 2]), max_new_tokens=3, reuse_segments=DOCS, segment_store=store)
    again = engine.generate(prompt_for([2, 1, 0]), max_new_tokens=3, reuse_segments=DOCS, segment_store=store, recompute=0.0)
    assert (first.stats.segment_hits, first.stats.segment_misses) == (0, 3)
    assert (again.stats.segment_hits, again.stats.segment_misses, again.stats.recomputed_prompt_tokens) == (3, 0, 0)
    assert again.stats.reused_prompt_tokens + again.stats.prefilled_prompt_tokens == again.usage.prompt_tokens
    assert again.stats.reused_prompt_tokens > again.usage.prompt_tokens // 2
    missing = engine.generate(prompt_for([0]), max_new_tokens=2, reuse_segments=["absent text"])
    assert missing.stats.segment_reuse == "no segment found in the rendered prompt"
    assert engine.generate(prompt_for([0]), max_new_tokens=2).stats.segment_reuse is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"reuse_segments": "one string"}, "list of strings"),
        ({"reuse_segments": [1, 2]}, "list of strings"),
        ({"reuse_segments": DOCS, "recompute": 1.5}, "recompute"),
        ({"reuse_segments": DOCS, "recompute": True}, "recompute"),
        ({"reuse_segments": DOCS, "segment_store": "/tmp/x"}, "SegmentKVStore"),
    ],
)
def test_bad_reuse_arguments_fail_before_any_work(options, message, tok):
    engine = tiny_engine("llama", tok)
    with pytest.raises(InvalidGenerationParameterError, match=message):
        engine.generate(prompt_for([0]), max_new_tokens=2, **options)


def test_batches_refuse_reuse_segments(engine):
    with pytest.raises(InvalidGenerationParameterError, match="generate_batch"):
        engine.generate_batch([prompt_for([0]), prompt_for([1])], max_new_tokens=2, reuse_segments=DOCS)


# ----------------------------------------------------------------- the store


def entry(seed: int, m: int = 5) -> SegmentKV:
    g = torch.Generator().manual_seed(seed)
    return SegmentKV(list(range(seed, seed + m)), torch.randn(2, 2, m, 4, generator=g), torch.randn(2, 2, m, 4, generator=g), [1])


SHAPE = (2, 2, 4)


def test_disk_store_round_trip_survives_a_new_process_object(tmp_path):
    stored = entry(3)
    SegmentKVStore(tmp_path).put("sig", torch.float32, stored)
    reopened = SegmentKVStore(tmp_path)
    got = reopened.get("sig", torch.float32, stored.token_ids, SHAPE, [1])
    assert got is not None and torch.equal(got.keys, stored.keys) and torch.equal(got.values, stored.values)
    assert reopened.get("sig", torch.float32, stored.token_ids, SHAPE, [2]) is None  # another anchor
    assert reopened.get("other-model", torch.float32, stored.token_ids, SHAPE, [1]) is None
    assert reopened.get("sig", torch.bfloat16, stored.token_ids, SHAPE, [1]) is None
    assert (reopened.stats.hits, reopened.stats.misses) == (1, 3)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign", "shape", "tensor bytes", "no checksum"])
def test_damaged_or_foreign_files_are_refused_and_deleted(tmp_path, damage):
    store = SegmentKVStore(tmp_path)
    stored = entry(4)
    store.put("sig", torch.float32, stored)
    (path,) = list(tmp_path.glob("sig/*.safetensors"))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(256))
    elif damage == "foreign":  # another model's entry renamed into this key
        other = SegmentKVStore(tmp_path / "other")
        other.put("sig2", torch.float32, stored)
        path.write_bytes(next((tmp_path / "other").glob("sig2/*.safetensors")).read_bytes())
    elif damage == "tensor bytes":  # header intact, the data overwritten (0x7f bytes: huge floats)
        data = bytearray(path.read_bytes())
        data[-40:-8] = b"\x7f" * 32
        path.write_bytes(bytes(data))
    elif damage == "no checksum":  # a file of the format before checksums
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as handle:
            meta = {k: v for k, v in (handle.metadata() or {}).items() if k != "crc32"}
            tensors = {name: handle.get_tensor(name) for name in ("keys", "values")}
        save_file(tensors, str(path), metadata=meta)
    else:
        wrong = SegmentKV(stored.token_ids, torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), [1])
        SegmentKVStore(tmp_path).put("sig", torch.float32, wrong)
    assert store.get("sig", torch.float32, stored.token_ids, SHAPE, [1]) is None
    assert store.stats.refused == 1 and not path.exists()
    store.put("sig", torch.float32, stored)  # recomputed and stored again
    assert store.get("sig", torch.float32, stored.token_ids, SHAPE, [1]) is not None


def test_a_directory_that_cannot_be_written_is_read_but_not_written_with_one_warning(tmp_path, monkeypatch, caplog):
    import errno
    import logging

    import safetensors.torch

    stored = entry(5)
    SegmentKVStore(tmp_path).put("sig", torch.float32, stored)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(safetensors.torch, "save_file", read_only)
    store = SegmentKVStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="snapkv_rag.reuse.segment_store"):
        assert store.put("sig", torch.float32, entry(6)) is False
        assert store.put("sig", torch.float32, entry(7)) is False
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1 == len(caplog.records)
    assert "Read-only file system" in caplog.records[0].getMessage() and "Read-only" in store.unwritable
    assert store.get("sig", torch.float32, stored.token_ids, SHAPE, [1]) is not None  # reading goes on
    assert not list(tmp_path.glob("sig/.*.tmp"))


def test_a_store_whose_directory_cannot_be_made_answers_without_storing(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = SegmentKVStore(blocker / "kv")  # mkdir fails: a file sits where the parent should be
    assert store.unwritable is not None
    assert store.put("sig", torch.float32, entry(8)) is False
    assert store.get("sig", torch.float32, entry(8).token_ids, SHAPE, [1]) is None


def test_disk_store_is_bounded_least_recently_used_first(tmp_path):
    SegmentKVStore(tmp_path / "probe").put("s", torch.float32, entry(0))
    size = next((tmp_path / "probe").glob("s/*")).stat().st_size
    store = SegmentKVStore(tmp_path / "bounded", max_bytes=int(size * 2.5))
    first, second, third = entry(10), entry(20), entry(30)
    store.put("s", torch.float32, first)
    store.put("s", torch.float32, second)
    past = os.path.getmtime(next((tmp_path / "bounded").glob("s/*"))) - 100
    for path in (tmp_path / "bounded").glob("s/*"):
        os.utime(path, (past, past))
    assert store.get("s", torch.float32, first.token_ids, SHAPE, [1]) is not None  # now the most recent
    store.put("s", torch.float32, third)
    assert len(store) == 2 and store.stats.evictions == 1
    assert store.get("s", torch.float32, second.token_ids, SHAPE, [1]) is None
    assert store.get("s", torch.float32, first.token_ids, SHAPE, [1]) is not None
    assert not SegmentKVStore(tmp_path / "tiny", max_bytes=10).put("s", torch.float32, first)


def test_salted_folders_emptied_by_eviction_are_removed(tmp_path):
    """Each cache_salt stores chunk K/V in a folder of its own: a client sending new salts must not
    leave an unbounded trail of empty folders once their files are evicted."""
    SegmentKVStore(tmp_path / "probe").put("s", torch.float32, entry(0))
    size = next((tmp_path / "probe").glob("s/*")).stat().st_size
    store = SegmentKVStore(tmp_path / "kv", max_bytes=int(size * 1.5))
    for salt in range(6):
        assert store.put(f"sig-{salt}", torch.float32, entry(salt))
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["sig-5"]
    assert store.unwritable is None and store.put("sig-0", torch.float32, entry(0))  # a removed folder is made again


def test_memory_store_is_bounded():
    one = entry(1)
    store = SegmentKVStore(max_bytes=one.nbytes * 2)
    for seed in (1, 2, 3):
        store.put("s", torch.float32, entry(seed))
    assert len(store) == 2 and store.nbytes == 2 * one.nbytes and store.stats.evictions == 1
    assert store.get("s", torch.float32, one.token_ids, SHAPE, [1]) is None


def _write_many(directory: str, rounds: int) -> None:
    store = SegmentKVStore(directory)
    for _ in range(rounds):
        store.put("sig", torch.float32, entry(7, m=64))


def test_concurrent_writers_of_one_key_leave_a_whole_file(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(tmp_path), 15)) for _ in range(2)]
    for w in writers:
        w.start()
    reader = SegmentKVStore(tmp_path)
    expected = entry(7, m=64)
    seen = 0
    while any(w.is_alive() for w in writers):
        got = reader.get("sig", torch.float32, expected.token_ids, SHAPE, [1])
        if got is not None:
            seen += 1
            assert torch.equal(got.keys, expected.keys)
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert reader.stats.refused == 0
    assert reader.get("sig", torch.float32, expected.token_ids, SHAPE, [1]) is not None
    assert not list(tmp_path.glob("sig/.*.tmp"))


def test_compute_segment_drops_the_anchor(tok):
    engine = tiny_engine("llama", tok)
    ids = engine.tokenizer(DOCS[1])["input_ids"][:12]
    computed = compute_segment(engine.model, ids, [1])
    keys, _ = layer_kv(engine.model, torch.tensor([[1, *ids]]), torch.arange(13)[None])
    assert computed.keys.shape == (2, 2, 12, 16) and computed.anchor == [1]
    torch.testing.assert_close(computed.keys[0], keys[0][0, :, 1:])


def test_a_32k_prompt_blends_on_a_40k_context_model(tok):
    """The long path end to end: 33K prompt tokens from 170 stored segments, SnapKV selecting."""
    engine = tiny_engine("llama", tok, context=40_960)
    words = [w for w in " ".join(DOCS).split() if w.isalpha()]
    docs = [" ".join(words[(i * 7 + k) % len(words)] for k in range(140)) + f" item {i}." for i in range(170)]
    prompt = "Documents:\n\n" + "\n\n".join(f"[{i + 1}]\n{d}" for i, d in enumerate(docs)) + f"\n\n{QUESTION}"
    policy = SnapKV(window_size=16, max_capacity_prompt=2048)
    store = SegmentKVStore()
    first = engine.generate(prompt, compression=policy, max_new_tokens=3, reuse_segments=docs, segment_store=store, question=QUESTION)
    assert first.usage.prompt_tokens > 32_000
    again = engine.generate(prompt, compression=policy, max_new_tokens=3, reuse_segments=docs[::-1], segment_store=store, question=QUESTION)
    ordered = engine.generate(prompt, compression=policy, max_new_tokens=3, reuse_segments=docs, segment_store=store, question=QUESTION)
    assert ordered.stats.segment_hits == first.stats.segment_misses == len(docs)
    assert ordered.stats.kept_tokens_per_layer == [2048, 2048]
    assert ordered.stats.reused_prompt_tokens > 0.8 * 32_000
    assert again.stats.segment_hits == len(docs)  # segments are found in any order


def test_an_exact_stored_prefix_that_covers_more_wins(tok):
    """An agent's history grows append-only: the previous prompt, stored whole, covers more
    than the new tool log would, so the call stays exact (and is stored for the next turn)."""
    engine = tiny_engine("llama", tok)
    store = SegmentKVStore()
    history = "Documents:\n\n" + "\n\n".join(DOCS[:2]) + "\n\nSummarise them."
    engine.generate(history, max_new_tokens=2)  # stored in the prefix cache, no segments
    log = "Tool output: the passkey is 1234 and the capital of France is Paris."
    turn = engine.generate(history + "\n\n" + log + "\n\nAnd now?", max_new_tokens=2, reuse_segments=[*DOCS[:2], log], segment_store=store)
    assert turn.stats.segment_reuse.startswith("an exact stored prefix covered more")
    assert turn.stats.reused_prompt_tokens > 0 and turn.stats.recomputed_prompt_tokens == 0
    fresh = engine.generate("Other text entirely.\n\n" + "\n\n".join(DOCS[:2]) + "\n\nQ?", max_new_tokens=2, reuse_segments=DOCS[:2], segment_store=store)
    assert fresh.stats.segment_reuse == "blended"

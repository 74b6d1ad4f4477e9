"""Rolling prefill (``rolling=N``): a prompt read N tokens at a time into a cache cut back to the
budget after each chunk, positions packed, so a prompt past the model's window runs in bounded memory."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import gemma3_engine, tiny_engine, tiny_model

from snapkv_rag.compression import H2O, RandomKeep, SnapKV, StreamingLLM, parse_compression
from snapkv_rag.engine.generation import DecodeRun
from snapkv_rag.engine.preparation import resolve_policy
from snapkv_rag.engine.prompts import render_prompt
from snapkv_rag.engine.rolling import pack_positions, rolling_plan
from snapkv_rag.engine.sampling import GenerationParams
from snapkv_rag.errors import InvalidCompressionError, PromptTooLongError
from snapkv_rag.reuse.blending import RopeShift, layer_kv, model_rope_shift

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def long_text(words: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (words,), generator=g).tolist()
    return " ".join(WORDS[i] for i in picks)


@pytest.fixture(scope="module")
def short_engine(tokenizer):
    """A model whose window (256 positions) is shorter than the prompts below."""
    return tiny_engine("llama", tokenizer, context=256)


def record_positions(model) -> tuple[list[int], object]:
    """The highest position id of every forward of ``model`` (a forward pre-hook)."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is not None:
            seen.append(int(positions.max()))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def prefill_logits(engine, prompt: str, policy) -> tuple[torch.Tensor, DecodeRun]:
    row = render_prompt(engine.tokenizer, prompt)
    resolved = resolve_policy(engine, policy, [prompt], None, [None])
    resolved = resolved[0] if isinstance(resolved, list) else resolved
    run = DecodeRun(engine.model, [row], GenerationParams(max_new_tokens=1), resolved, engine._pad_id)
    return run.prefill(), run


@pytest.mark.parametrize(
    "spec", ["snapkv:budget=64,window=8", "snapkv:budget=96,window=question", "h2o:budget=64", "streamingllm:budget=64", "random:budget=64"]
)
def test_a_prompt_that_fits_one_chunk_is_prefilled_whole(engine, spec):
    prompt = long_text(40) + "\nWhat comes after alpha?"
    whole = engine.generate(prompt, compression=spec, max_new_tokens=6)
    rolled = engine.generate(prompt, compression=spec + ",rolling=4096", max_new_tokens=6)
    assert rolled.token_ids == whole.token_ids
    assert rolled.stats.kept_tokens_per_layer == whole.stats.kept_tokens_per_layer
    assert "rolled_chunks" not in rolled.stats.policy_stats


@pytest.mark.parametrize("window", ["8", "question"])
def test_rolling_that_evicts_nothing_equals_a_whole_prefill(engine, window):
    """With a budget above the prompt nothing is cut: each chunk's appended window is dropped again
    and the positions stay as they were, so the last logits are the whole prefill's (fp32)."""
    prompt = long_text(60) + "\nWhich word comes first?"
    assert engine.count_tokens(prompt) < 400
    full, _ = prefill_logits(engine, prompt, None)
    rolled, run = prefill_logits(engine, prompt, parse_compression(f"snapkv:budget=400,window={window},rolling=32"))
    assert run.rolling is not None and run.rolling.chunks > 3
    torch.testing.assert_close(rolled, full, atol=1e-4, rtol=1e-4)


def test_packed_keys_are_the_keys_computed_at_the_packed_positions(engine):
    """Layer 0's keys depend only on the token and its position: after moving kept entries to
    0..k-1 they must equal the keys of the same tokens computed there."""
    model = engine.model
    ids = torch.randint(10, 300, (1, 40))
    keys, values = layer_kv(model, ids, torch.arange(40)[None], layers=1)
    kept = torch.tensor([0, 3, 4, 9, 17, 18, 30, 39])
    indices = kept.expand(1, keys[0].shape[1], -1)

    class Layer:
        pass

    layer = Layer()
    layer.keys, layer.values = keys[0][:, :, kept], values[0][:, :, kept]
    cache = type("Cache", (), {"layers": [layer]})()
    assert pack_positions(cache, {0: indices}, RopeShift(model)) == len(kept)
    expected, _ = layer_kv(model, ids[:, kept], torch.arange(len(kept))[None], layers=1)
    torch.testing.assert_close(layer.keys, expected[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "spec",
    ["snapkv:budget=48,window=question,max_window=32", "snapkv:budget=48,window=16,kernel=5", "h2o:budget=48", "streamingllm:budget=48", "random:budget=48"],
)
def test_every_sparse_policy_reads_past_the_window_within_the_bound(short_engine, spec):
    prompt = long_text(600, seed=1) + "\nWhat is the first word?"
    n = short_engine.count_tokens(prompt)
    assert n > 3 * short_engine.context_length
    seen, handle = record_positions(short_engine.model)
    try:
        result = short_engine.generate(prompt, compression=spec + ",rolling=64", max_new_tokens=8, ignore_eos=True)
    finally:
        handle.remove()
    stats = result.stats.policy_stats
    window = 64  # the largest window any of these policies uses (question windows are clipped to 64)
    assert stats["rolled_chunks"] >= n // 64
    assert stats["rolling_peak_entries"] <= 48 + 64 + window
    assert max(seen) <= 48 + 64 + window + 8  # prompt positions, then 8 generated tokens
    assert stats["rolling_max_position"] == max(seen[: stats["rolled_chunks"]])
    assert max(result.stats.kept_tokens_per_layer) <= 48
    assert result.usage.prompt_tokens == n and result.usage.completion_tokens == 8


def test_a_sparse_policy_reads_past_the_window_by_the_one_rule_and_the_full_cache_names_rolling(short_engine):
    """The engine asks fit_to_window for every call: a sparse policy without rolling= is read rolled in
    the largest chunk that fits (budget + chunk + window + answer <= the window); the full cache cannot."""
    prompt = long_text(600, seed=2)
    result = short_engine.generate(prompt, compression="snapkv:budget=48,window=16", max_new_tokens=4)
    assert result.stats.compression["rolling"] == 256 - 48 - 16 - 4
    assert result.stats.policy_stats["rolled_chunks"] >= 3 and max(result.stats.kept_tokens_per_layer) <= 48
    fits = short_engine.generate("A short prompt.", compression="snapkv:budget=48,window=16", max_new_tokens=4)
    assert "rolling" not in fits.stats.compression
    for full in (None, "full", "less:base=snapkv,budget=48,window=16"):
        with pytest.raises((PromptTooLongError, InvalidCompressionError), match="rolling=|LESS"):
            short_engine.generate(prompt, compression=full, max_new_tokens=4)
    with pytest.raises(PromptTooLongError, match="rolling="):
        short_engine.generate(prompt, max_new_tokens=4)


def test_rolled_rows_in_a_batch_equal_each_rolled_alone(short_engine):
    prompts = [long_text(500, seed=3) + "\nFirst word?", long_text(350, seed=4) + "\nLast word?"]
    spec = "snapkv:budget=48,window=question,max_window=32,rolling=64"
    alone = [short_engine.generate(p, compression=spec, max_new_tokens=6).token_ids for p in prompts]
    batch = short_engine.generate_batch(prompts, compression=spec, max_new_tokens=6)
    assert [r.token_ids for r in batch] == alone


def test_a_rolled_prefill_interleaves_with_another_request(short_engine):
    spec = "snapkv:budget=48,window=question,max_window=32,rolling=64"
    long_prompt = long_text(600, seed=5) + "\nFirst word?"
    expected_long = short_engine.generate(long_prompt, compression=spec, max_new_tokens=6).token_ids
    expected_short = short_engine.generate("hello world", max_new_tokens=40, ignore_eos=True).token_ids
    out: dict[str, list[int]] = {}
    stream = short_engine.stream("hello world", max_new_tokens=40, ignore_eos=True)
    thread = threading.Thread(target=lambda: out.__setitem__("long", short_engine.generate(long_prompt, compression=spec, max_new_tokens=6).token_ids))
    thread.start()
    for _ in stream:
        pass
    thread.join()
    assert out["long"] == expected_long and stream.result.token_ids == expected_short


def test_decode_time_cuts_continue_from_the_packed_positions(short_engine):
    prompt = long_text(500, seed=6)
    result = short_engine.generate(
        prompt, compression="snapkv:budget=48,window=8,rolling=64,decode_budget=32,decode_interval=8", max_new_tokens=24, ignore_eos=True
    )
    assert result.usage.completion_tokens == 24
    assert result.stats.policy_stats["rolled_chunks"] > 1


def test_the_plan_splits_the_body_and_ends_with_the_window():
    policy = SnapKV(max_capacity_prompt=64, window_size=8, rolling=16)
    plan = rolling_plan(50, policy)
    assert plan is not None
    assert plan.window == (42, 50)
    assert plan.chunks == [(0, 16), (16, 32), (32, 50)]
    assert rolling_plan(24, policy) is None  # body of 16: one chunk, prefilled whole
    assert rolling_plan(500, H2O(max_capacity_prompt=64, rolling=100)).window is None


@pytest.mark.parametrize(
    "spec, message",
    [
        ("snapkv:budget=64,rolling=0", "rolling must be an integer >= 16"),
        ("snapkv:budget=64,rolling=abc", "rolling must be an integer >= 16"),
        ("snapkv:budget=64,heads=adaptive,rolling=64", "rolling= does not combine with heads=.adaptive"),
        ("snapkv:budget=64,layers=pyramid,rolling=64", "same budget in every layer .layers=.uniform"),
        ("snapkv:budget=64,whole=1,rolling=64", "rolling= does not combine with whole"),
        ("less:base=snapkv,budget=64,rolling=64", "LESS"),
        ("full:rolling=64", "rolling"),
    ],
)
def test_settings_a_rolling_prefill_cannot_honour_are_one_clear_error(spec, message):
    with pytest.raises(InvalidCompressionError, match=message):
        parse_compression(spec)


def test_the_spec_round_trips_with_rolling():
    for policy in (
        SnapKV(max_capacity_prompt=64, rolling=32),
        H2O(max_capacity_prompt=64, rolling=32),
        StreamingLLM(max_capacity_prompt=64, rolling=32),
        RandomKeep(max_capacity_prompt=64, rolling=32),
    ):
        assert parse_compression(policy.spec()) == policy
        assert "rolling=32" in policy.spec()
    assert "rolling" not in SnapKV().spec()


@pytest.fixture(scope="module")
def gemma3(tokenizer):
    """A tiny Gemma 3 (a sliding-window layer with its own rotary frequencies, then a full one)
    whose sliding window (48) spans more than one rolled chunk of 32."""
    return gemma3_engine(tokenizer, sliding_window=48, context=512)


@pytest.mark.parametrize("window", ["8", "question"])
def test_a_sliding_window_model_rolls_to_the_whole_prefill_when_nothing_is_evicted(gemma3, window):
    """The sliding layer drops each chunk's appended window, keeps the text's last W - 1 entries and
    its count of tokens seen follows the packed positions, so with nothing cut the last logits are
    the whole prefill's (fp32), with the sliding mask reaching back across chunks."""
    prompt = long_text(60) + "\nWhich word comes first?"
    full, _ = prefill_logits(gemma3, prompt, None)
    rolled, run = prefill_logits(gemma3, prompt, parse_compression(f"snapkv:budget=400,window={window},rolling=32"))
    assert run.rolling is not None and run.rolling.chunks > 3
    torch.testing.assert_close(rolled, full, atol=1e-4, rtol=1e-4)
    sliding = run.cache.layers[0]
    assert sliding.keys.shape[2] == 47 and not sliding.record_past
    assert sliding.cumulative_length == gemma3.count_tokens(prompt)


def test_a_sliding_layers_moved_window_holds_the_keys_computed_at_the_packed_positions(gemma3):
    """Cut and packed, the sliding layer's last W - 1 entries sit right before the next chunk:
    its layer-0 keys equal those of the same tokens computed at the packed positions (with the
    sliding layers' own rotary base, not the global one)."""
    from snapkv_rag.engine.rolling import SlidingWindows

    model = gemma3.model
    ids = torch.randint(10, 300, (1, 80))
    keys, values = layer_kv(model, ids, torch.arange(80)[None], layers=1)  # layer 0 slides: it keeps tokens 33..79

    class Layer:
        sliding_window = 48

    layer = Layer()
    layer.keys, layer.values = keys[0], values[0]
    windows = SlidingWindows(type("Cache", (), {"layers": [layer]})(), [0])
    windows.move(boundary=76, packed=60, window=4, shift=model_rope_shift(model, sliding=True))  # 76 text tokens, then 4 of a window
    assert layer.cumulative_length == 60 and layer.keys.shape[2] == 43  # tokens 33..75, now at 17..59
    expected, _ = layer_kv(model, ids[:, 33:76], torch.arange(17, 60)[None], layers=1)
    torch.testing.assert_close(layer.keys, expected[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", [64, 24])  # 24: less than the sliding window, which then keeps only the budget
def test_a_sliding_window_model_reads_past_its_window_within_the_bound(tokenizer, budget):
    engine = gemma3_engine(tokenizer, sliding_window=48, context=256)
    prompt = long_text(600, seed=3) + "\nWhat is the first word?"
    n = engine.count_tokens(prompt)
    assert n > 3 * engine.context_length
    seen, handle = record_positions(engine.model)
    try:
        result = engine.generate(prompt, compression=f"snapkv:budget={budget},window=question,max_window=16,rolling=64", max_new_tokens=6, ignore_eos=True)
    finally:
        handle.remove()
    stats = result.stats.policy_stats
    assert stats["rolling_peak_entries"] <= budget + 64 + 16
    assert max(seen) <= budget + 64 + 16 + 6
    assert result.usage.prompt_tokens == n and result.usage.completion_tokens == 6


def test_a_model_whose_every_layer_slides_is_refused_with_rolling(tokenizer):
    from snapkv_rag import Engine

    model = tiny_model("gemma", len(tokenizer))
    model.config.layer_types = ["sliding_attention", "sliding_attention"]
    model.config.sliding_window = 32
    engine = Engine(model, tokenizer, name="tiny-all-sliding")
    with pytest.raises(InvalidCompressionError, match="every layer"):
        engine.generate(long_text(300), compression="snapkv:budget=48,rolling=64", max_new_tokens=2)


def test_a_rolled_prefill_records_no_kept_positions(short_engine):
    """Kept indices of a rolled chunk are positions in that chunk's forward, not in the prompt:
    the kept-entries recorder (the app's picture) hears of none rather than of wrong ones."""
    from snapkv_rag.compression import recording_kept_indices

    with recording_kept_indices() as kept:
        short_engine.generate(long_text(600, seed=7), compression="snapkv:budget=48,window=8,rolling=64", max_new_tokens=2)
    assert kept == []
    short = long_text(10, seed=7)
    assert short_engine.count_tokens(short) <= 64 + 8
    with recording_kept_indices() as kept:
        short_engine.generate(short, compression="snapkv:budget=48,window=8,rolling=64", max_new_tokens=2)
    assert len(kept) == 1  # one chunk: a whole prefill, recorded as before

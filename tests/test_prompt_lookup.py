"""Prompt-lookup drafts (``prompt_lookup_num_tokens``, snapkv_rag.engine.lookup): greedy output is
the undrafted one token for token (fp32 tiny models), whatever the cache's shape; drafting is off,
with the reason in the stats, where it could not be exact."""

from __future__ import annotations

import pytest
from conftest import ForwardProbe, terse_bias, tiny_engine, tiny_tool_engine
from test_less import active_kernels

from snapkv_rag.compression import LESS, SnapKV
from snapkv_rag.engine.lookup import DraftIndex, DraftStats
from snapkv_rag.errors import InvalidGenerationParameterError

# Repetitive prompts: the tiny random models fall into loops over their n-grams, so drafts are
# accepted in part and rejected in part.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. " * 4,
    "Numbers like 1234 and 5678 appear in passkeys. Hello world, hello engine! " * 3,
    "Hello world",
]
SNAP = "snapkv:budget=24,window=4"


@pytest.fixture(scope="module")
def lookup_engine(tokenizer):
    return tiny_engine("llama", tokenizer, seed=0)


def greedy(engine, prompt, k=0, **options):
    options = {"max_new_tokens": 40, "ignore_eos": True, **options}
    return engine.generate(prompt, prompt_lookup_num_tokens=k, **options)


def test_the_index_drafts_what_followed_the_longest_latest_match():
    index = DraftIndex([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert index.draft(3) == ([7, 8, 5], 2)  # "2 3" last occurred before 7 ("3" alone: before 7 too)
    index.append(7)
    assert index.draft(2) == ([8, 5], 3)  # "2 3 7" now matches, three tokens long
    assert index.draft(10) == ([8, 5, 2, 3, 7], 3)  # a draft runs up to the text's end
    assert DraftIndex([4, 5, 6]).draft(4) == ([], 0)  # "6" never occurred before
    assert DraftIndex([]).draft(4) == ([], 0)


@pytest.mark.parametrize("compression", [None, SNAP, "h2o:budget=24", "streamingllm:budget=24"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_output_is_the_undrafted_one(lookup_engine, compression, k):
    accepted = rejected = 0
    for prompt in PROMPTS:
        plain = greedy(lookup_engine, prompt, compression=compression, prefix_cache=False)
        drafted = greedy(lookup_engine, prompt, k, compression=compression, prefix_cache=False)
        assert drafted.token_ids == plain.token_ids
        assert drafted.text == plain.text
        assert drafted.usage.completion_tokens == 40
        stats = drafted.stats.drafts
        assert "draft_off" not in stats and stats["prompt_lookup_num_tokens"] == k
        accepted += stats["accepted_draft_tokens"]
        rejected += stats["drafted_tokens"] - stats["accepted_draft_tokens"]
        # one forward per token not drafted (the last one's drafts may end the answer)
        assert drafted.stats.decode_steps in (39 - stats["accepted_draft_tokens"], 40 - stats["accepted_draft_tokens"])
    assert accepted > 0 and rejected > 0  # both ways through the cache's trimming


def test_short_answers_and_max_new_tokens_are_kept_exactly(lookup_engine):
    for n in (1, 2, 5, 7):
        plain = greedy(lookup_engine, PROMPTS[0], max_new_tokens=n, prefix_cache=False)
        drafted = greedy(lookup_engine, PROMPTS[0], 8, max_new_tokens=n, prefix_cache=False)
        assert drafted.token_ids == plain.token_ids and len(drafted.token_ids) == n


def test_drafts_over_a_reused_prefix_and_a_rolled_prefill(lookup_engine, tokenizer):
    first = greedy(lookup_engine, PROMPTS[0], 4, compression=SNAP)
    greedy(lookup_engine, PROMPTS[0], 4, compression=SNAP)  # a compressed prompt is stored when it repeats
    again = greedy(lookup_engine, PROMPTS[0], 4, compression=SNAP)
    assert again.stats.reused_prompt_tokens > 0 and again.token_ids == first.token_ids
    short = tiny_engine("llama", tokenizer, context=256)
    prompt = PROMPTS[1] * 6
    assert short.count_tokens(prompt) > 256
    spec = "snapkv:budget=64,window=8,rolling=64"
    plain = greedy(short, prompt, compression=spec)
    drafted = greedy(short, prompt, 4, compression=spec)
    assert drafted.token_ids == plain.token_ids and drafted.stats.drafts["draft_forwards"] > 0


def test_less_state_stays_exact_under_drafts(tokenizer):
    engine = tiny_engine("llama", tokenizer, seed=3)
    policy = LESS(base=SnapKV(window_size=4, max_capacity_prompt=16, kernel_size=3), kernels=active_kernels(engine))
    for prompt in PROMPTS[:2]:
        plain = greedy(engine, prompt, compression=policy, prefix_cache=False)
        drafted = greedy(engine, prompt, 4, compression=policy, prefix_cache=False)
        assert drafted.token_ids == plain.token_ids
        assert drafted.stats.drafts["draft_forwards"] > 0
        assert drafted.stats.policy_stats["low_rank_folded_entries"] == plain.stats.policy_stats["low_rank_folded_entries"]


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"temperature": 0.8, "seed": 1}, "sampling"),
        ({"compression": "snapkv:budget=24,window=4,decode_budget=32,decode_interval=8"}, "decode-time cuts"),
        ({"compression": "snapkv:budget=24,window=4,heads=adaptive"}, "per-head budgets"),
        ({"attend_to": ["The quick brown fox"]}, "attention over spans"),
    ],
)
def test_where_drafts_cannot_be_exact_they_are_off_and_the_stats_say_why(lookup_engine, options, reason):
    result = greedy(lookup_engine, PROMPTS[0], 4, **{"max_new_tokens": 12, **options})
    assert reason in result.stats.drafts["draft_off"]
    assert set(result.stats.drafts) == {"prompt_lookup_num_tokens", "draft_off"}
    if "temperature" not in options:
        assert result.token_ids == greedy(lookup_engine, PROMPTS[0], **{"max_new_tokens": 12, **options}).token_ids


def outcome(result):
    """What a constrained call produced (tool call ids are random, so names and arguments)."""
    return result.token_ids, result.finish_reason, [(c.name, c.arguments) for c in result.tool_calls], result.parsed


def test_tool_calls_and_json_under_drafts_equal_the_undrafted_ones(smollm_tokenizer):
    engine = tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer, strength=3.0))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    record = 'Result: {"q": "ferry times", "q": "ferry times", "q": "ferry times"} ' * 3
    calls = [
        (record + "Look it up.", {"max_new_tokens": 80, "tools": tools, "tool_choice": "required"}),
        (record + "Answer in JSON.", {"max_new_tokens": 80, "response_format": {"type": "json_object"}}),
        (record + "Answer in JSON, near the limit.", {"max_new_tokens": 12, "response_format": {"type": "json_object"}}),
    ]
    accepted = 0
    for prompt, options in calls:
        plain = engine.generate(prompt, prefix_cache=False, **options)
        drafted = engine.generate(prompt, prefix_cache=False, prompt_lookup_num_tokens=4, **options)
        assert outcome(drafted) == outcome(plain)
        assert "draft_off" not in drafted.stats.drafts
        accepted += drafted.stats.drafts["accepted_draft_tokens"]
    assert accepted > 0  # draft tokens went through the grammar's mask


def test_a_batch_of_prompts_decodes_without_drafts(lookup_engine):
    results = lookup_engine.generate_batch(PROMPTS[:2], max_new_tokens=8, ignore_eos=True, prompt_lookup_num_tokens=4, bucket=False)
    assert all("several prompts" in r.stats.drafts["draft_off"] for r in results)


def test_beside_other_requests_a_drafting_request_decodes_one_token_per_step(lookup_engine):
    alone = greedy(lookup_engine, PROMPTS[0], 4, max_new_tokens=60)
    other_alone = greedy(lookup_engine, PROMPTS[1], max_new_tokens=200)
    with ForwardProbe(lookup_engine.model, sleep_s=0.005):
        other = lookup_engine.stream(PROMPTS[1], max_new_tokens=200, ignore_eos=True)  # decoding from here on
        stream = lookup_engine.stream(PROMPTS[0], max_new_tokens=60, ignore_eos=True, prompt_lookup_num_tokens=4)
        pieces = list(stream)
        list(other)
    together = stream.result
    assert together.token_ids == alone.token_ids and "".join(pieces) == together.text
    assert other.result.token_ids == other_alone.token_ids
    stats = together.stats.drafts
    assert stats["draft_shared_steps"] > 0 and together.stats.decode_batch_rows_max == 2


def test_stop_strings_and_streams_end_where_undrafted_ones_do(lookup_engine):
    plain = greedy(lookup_engine, PROMPTS[0], prefix_cache=False)
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 3]
    want = greedy(lookup_engine, PROMPTS[0], stop=stop, prefix_cache=False)
    stream = lookup_engine.stream(PROMPTS[0], max_new_tokens=40, ignore_eos=True, stop=stop, prompt_lookup_num_tokens=8)
    pieces = list(stream)
    assert stream.result.text == want.text == "".join(pieces) and stream.result.finish_reason == "stop"


@pytest.mark.parametrize("bad", [-1, 65, 2.5, "4", True])
def test_bad_draft_lengths_are_one_clear_error(lookup_engine, bad):
    with pytest.raises(InvalidGenerationParameterError, match="prompt_lookup_num_tokens"):
        lookup_engine.generate("Hello", prompt_lookup_num_tokens=bad)


def test_stats_and_timings_count_tokens_per_forward(lookup_engine):
    result = greedy(lookup_engine, PROMPTS[0], 8, prefix_cache=False)
    stats = result.stats.drafts
    forwards = result.stats.decode_steps
    assert stats["tokens_per_forward"] == pytest.approx((forwards + stats["accepted_draft_tokens"]) / forwards, abs=1e-3)
    assert forwards + stats["accepted_draft_tokens"] in (39, 40)
    assert 0 < stats["draft_acceptance"] <= 1
    assert result.stats.decode_ms_per_token is not None and result.stats.decode_ms_per_token > 0
    empty = DraftStats(4).to_dict()
    assert empty["draft_acceptance"] is None and empty["tokens_per_forward"] is None
    assert greedy(lookup_engine, PROMPTS[0], max_new_tokens=4).stats.drafts is None  # not asked for

"""Recipe 4: the compression-aware examples (generator and loss) and the near misses, on a tiny model."""

from __future__ import annotations

import random
import re

import pytest
import torch
from conftest import load_smollm_tokenizer

from snapkv_rag.adapter_training.compressed_reads import READ_BUDGETS, READ_CUES, CompressedReadGenerator, compressed_example_loss
from snapkv_rag.adapter_training.dataset import build_examples
from snapkv_rag.adapter_training.examples import Example
from snapkv_rag.adapter_training.tool_data import HELD_OUT_TOOLS, NEAR_MISS
from snapkv_rag.compression import as_policy
from snapkv_rag.compression.runtime import register_attention_functions, wrapped_name
from snapkv_rag.engine.generation import DecodeRun, GenerationParams
from snapkv_rag.engine.prompts import question_tail_tokens, render_prompt
from snapkv_rag.lookalike_world import HELD_OUT_DOMAINS
from snapkv_rag.rag.store import StoredChunk
from snapkv_rag.rag.stuffing import build_messages
from snapkv_rag.testing import tiny_model

SMALL_READ = "snapkv:budget=96,window=question,max_window=32,rolling=128"


@pytest.fixture(scope="module")
def tok():
    return load_smollm_tokenizer()


def _documents(text: str) -> list[str]:
    return re.findall(r"\[\d+\][^\n]*\n((?:.+\n?)+?)(?:\n|$)", text)


def test_recipe_3_data_is_unchanged_and_recipe_4_adds_reads_and_near_misses():
    three = build_examples(0, 300)
    assert not {"qa_read", "tool_near_miss"} & {e.kind for e in three}
    assert all("read" not in e.to_dict() for e in three)  # recipe 3's fingerprint does not move
    four = build_examples(0, 300, recipe=4)
    kinds = {e.kind for e in four}
    assert {"qa_read", "tool_near_miss", "qa_one", "tool_call"} <= kinds
    assert [e.to_dict() for e in four] == [e.to_dict() for e in build_examples(0, 300, recipe=4)]
    reads = [e for e in four if e.kind == "qa_read"]
    assert all(as_policy(e.read).max_capacity_prompt == 1024 for e in reads)
    assert any("rolling=2048" in e.read for e in reads) and any("rolling" not in e.read for e in reads)


FACT_PATTERNS = {"noun": r"[a-z ]+?", "role": r"[a-z ]+?", "year": r"\d{4}", "time": r"\d{1,2}:\d{2} a\.m\.", "leader": r"[A-Z][\w'-]+(?: [A-Z][\w'-]+)+"}


def _cue_fact(question: str, wording: str) -> str | None:
    pattern = re.escape(wording)
    for name, fact in FACT_PATTERNS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{fact})")
    match = re.search(pattern, question)
    return next(v for k, v in match.groupdict().items() if k not in ("noun", "role")) if match else None


def test_a_read_stuffs_its_budget_and_its_cue_names_the_cited_document(tok):
    generator = CompressedReadGenerator(random.Random(5), count_tokens=lambda text: len(tok(text, add_special_tokens=False)["input_ids"]))
    cued = 0
    for _ in range(20):
        example = generator.example()
        body = example.messages[-1]["content"]
        assert len(tok(body)["input_ids"]) >= min(READ_BUDGETS)
        assert example.domain not in HELD_OUT_DOMAINS
        cited = int(re.search(r"\[(\d+)\]\.$", example.target).group(1))
        question = body.rsplit("Question: ", 1)[1]
        if not example.template.startswith("read:"):
            continue
        cued += 1
        fact = _cue_fact(question, READ_CUES[example.template.split(":")[1]])
        assert fact is not None, question
        documents = {int(d.split("]", 1)[0]): d for d in body.split("\n\n[")[1:]}
        assert fact in documents[cited], (question, fact)
    assert cued >= 5


def test_no_two_documents_of_a_kind_share_a_cue_fact():
    rng = random.Random(1)
    generator = CompressedReadGenerator(rng)
    domain = generator.gold_domains[0]
    crowd: list = []
    for _ in range(40):
        crowd.append(generator._entity(domain, crowd))
    for key in ("year", "leader", "time"):
        assert len({e.facts[key] for e in crowd}) == len(crowd), key
    years = {e.facts["year"] for e in crowd}
    assert not years & {str(e.leader_since) for e in crowd}  # "founded in 1990" is no other's "since 1990"


def test_the_held_out_reads_and_near_misses_stay_apart():
    train, held = build_examples(0, 400, recipe=4), build_examples(0, 200, "heldout", recipe=4)
    held_reads = [e for e in held if e.kind == "qa_read"]
    assert held_reads and all(e.domain in HELD_OUT_DOMAINS for e in held_reads)
    assert all(len(e.messages[-1]["content"]) // 4 < 4000 * 1.3 for e in held_reads)  # the probe reads at most 4K
    near_train = {e.template for e in train if e.kind == "tool_near_miss"}
    near_held = {e.template for e in held if e.kind == "tool_near_miss"}
    assert near_train and near_held and not near_train & near_held
    assert all(t.split(":")[1] in HELD_OUT_TOOLS for t in near_held)
    for example in (e for e in train if e.kind == "tool_near_miss"):
        offered = {t["function"]["name"] for t in example.tools}
        requests = dict(NEAR_MISS[example.template.split(":")[1]])
        assert example.messages[-1]["content"] in requests and "<tool_call>" not in example.target
        assert offered  # the tool on the request's topic is offered under its name or an alias


def _small_example() -> Example:
    chunks = [
        StoredChunk(id=str(i), text=f"Document {i} says the keeper of hall {i} is Person {i}. " * 6, source=f"s{i}.md", title=f"Hall {i}", position=0, tokens=0)
        for i in range(8)
    ]
    messages, _ = build_messages("Who keeps hall 3?", chunks)
    return Example("qa_read", messages, "Person 3 keeps it [4].", read=SMALL_READ)


def test_the_loss_reads_exactly_the_cache_decoding_reads_and_trains_only_the_answer(tok):
    torch.manual_seed(0)
    model = tiny_model("llama", len(tok), context=2048)
    register_attention_functions()
    model.set_attn_implementation(wrapped_name(model.config._attn_implementation))
    example = _small_example()
    loss, targets, prompt_tokens = compressed_example_loss(model, tok, example, 0)
    prompt = render_prompt(tok, example.messages)
    answer = tok(example.target + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert (targets, prompt_tokens) == (len(answer), len(prompt)) and prompt_tokens > 3 * 96
    # the engine's own teacher forcing through the same compressed, rolled cache gives the same loss
    policy = as_policy(SMALL_READ).for_prompt(question_tail_tokens(tok, example.messages, chat=True))
    run = DecodeRun(model, [prompt], GenerationParams(max_new_tokens=len(answer)), policy, 0)
    logits = run.teacher_force(answer)
    assert run.rolling is not None and run.rolling.chunks > 1
    reference = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(answer))
    assert float(loss.detach()) == pytest.approx(float(reference), abs=1e-4)
    # and a read of the full cache would not (the compression is applied)
    full = DecodeRun(model, [prompt], GenerationParams(max_new_tokens=len(answer)), None, 0).teacher_force(answer)
    assert abs(float(torch.nn.functional.cross_entropy(full.float(), torch.tensor(answer))) - float(loss.detach())) > 1e-3
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads and any(float(g.abs().sum()) > 0 for name, g in grads.items() if "q_proj" in name)


def test_recipe_4_trains_from_an_initial_adapter(tok, tmp_path):
    from safetensors.torch import load_file

    from snapkv_rag.adapter_training.train import TuneConfig, TuneError, tune

    settings = dict(model="", accumulate=1, warmup_steps=0, qa_share=0.0, eval_examples=0, rank=8, alpha=16, save_every=1)
    tune(TuneConfig(examples=3, learning_rate=1e-2, **settings), tmp_path / "first", model=tiny_model("llama", len(tok)), tokenizer=tok, progress=False)
    first = load_file(str(tmp_path / "first/adapter/adapter_model.safetensors"))
    config = TuneConfig(examples=1, learning_rate=1e-9, recipe=4, init_adapter=str(tmp_path / "first/adapter"), **settings)
    tune(config, tmp_path / "second", model=tiny_model("llama", len(tok)), tokenizer=tok, progress=False)
    second = load_file(str(tmp_path / "second/adapter/adapter_model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.allclose(first[k].float(), second[k].float(), atol=1e-6) for k in first)
    assert any(float(first[k].abs().sum()) > 0 for k in first if "lora_B" in k)  # not two zero adapters
    with pytest.raises(TuneError, match="no adapter_model"):
        TuneConfig(recipe=4, init_adapter=str(tmp_path)).check()
    with pytest.raises(TuneError, match="recipe"):
        TuneConfig(recipe=2).check()


def test_training_refuses_a_policy_that_cuts_the_cache_while_decoding(tok):
    model = tiny_model("llama", len(tok), context=2048)
    register_attention_functions()
    model.set_attn_implementation(wrapped_name(model.config._attn_implementation))
    prompt = render_prompt(tok, _small_example().messages)
    cutting = as_policy("snapkv:budget=64,window=8,decode_budget=96")
    run = DecodeRun(model, [prompt], GenerationParams(max_new_tokens=4), cutting, 0)
    with pytest.raises(ValueError, match="cuts the cache during decoding"):
        run.teacher_force([5, 6, 7], train=True)
    # the same read without training goes one token at a time, as decoding does
    assert DecodeRun(model, [prompt], GenerationParams(max_new_tokens=4), cutting, 0).teacher_force([5, 6, 7]).shape[0] == 3

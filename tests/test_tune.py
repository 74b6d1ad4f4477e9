"""snapkv-rag tune: the generated data (deterministic, held-out split disjoint, nothing of the
eval's text), block-attention masks, LoRA training that lowers the loss and resumes exactly, and
the adapter merged at load."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import load_smollm_tokenizer, tiny_model

from snapkv_rag.adapter_training import AdapterError, merge_adapter, resolve_adapter
from snapkv_rag.adapter_training.block_attention import block_attention_mask, with_anchor_copies
from snapkv_rag.adapter_training.dataset import build_examples, encode
from snapkv_rag.adapter_training.qa_data import QUESTIONS
from snapkv_rag.adapter_training.tool_data import ALIASES, FAMILIES, HELD_OUT_TOOLS, NO_TOOL
from snapkv_rag.lookalike_world import DOMAIN_BY_KEY, HELD_OUT_DOMAINS

CANONICAL = {alias: name for name, aliases in ALIASES.items() for alias in (name, *aliases)}

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm_tok():
    return load_smollm_tokenizer()


# --------------------------------------------------------------------------- data
def test_generator_is_deterministic_per_seed_and_split():
    a = [e.to_dict() for e in build_examples(3, 30)]
    assert a == [e.to_dict() for e in build_examples(3, 30)]
    assert a != [e.to_dict() for e in build_examples(4, 30)]
    # the held-out split does not depend on how many training examples were drawn
    assert [e.to_dict() for e in build_examples(3, 5, "heldout")] == [e.to_dict() for e in build_examples(3, 5, "heldout")]
    assert {e.kind for e in build_examples(0, 200)} == {
        "qa_one",
        "qa_two",
        "qa_none",
        "tool_call",
        "tool_calls",
        "tool_none",
        "tool_answer",
        "tool_unavailable",
    }


def _user_texts(examples):
    return {m["content"] for e in examples for m in e.messages if m["role"] == "user"}


def test_heldout_split_is_disjoint_from_training_by_domain_tool_and_template():
    train, held = build_examples(0, 600), build_examples(0, 300, "heldout")
    train_templates = {t for e in train for t in e.template.split("+")}
    held_templates = {t for e in held for t in e.template.split("+")}
    assert train_templates and held_templates and not train_templates & held_templates
    held_domains = {e.domain for e in held if e.kind.startswith("qa")}
    assert held_domains == set(HELD_OUT_DOMAINS)
    assert not {e.domain for e in train if e.kind.startswith("qa")} & held_domains
    # no held-out tool is ever the answer in training, and every held-out call is one
    called = lambda e: {CANONICAL[n] for n in re.findall(r'"name": "([a-z_]+)"', e.target)}  # noqa: E731
    assert not set().union(*(called(e) for e in train)) & set(HELD_OUT_TOOLS)
    assert set().union(*(called(e) for e in held if e.kind.startswith("tool"))) <= set(HELD_OUT_TOOLS)
    assert not _user_texts(train) & _user_texts(held)
    # the held-out domains' nouns never appear in a training document
    held_suffixes = {"Observatory", "Astronomical Station", "Vineyard", "Wine Cellars", "Ferries", "Ferry Company", "Sea Link"}
    train_docs = "\n".join(s for e in train for s in e.segments or [e.messages[-1]["content"]] if e.kind.startswith("qa"))
    assert not any(s in train_docs for s in held_suffixes)


def _shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_generated_data_shares_nothing_with_the_eval_text():
    """The sample corpus, its questions and the eval's tool sets are what the gates measure on:
    no run of 8 words of a corpus document, and no run of 7 words of a question (a common frame
    such as "who is the artistic director of" is not the question), appears in generated text."""
    texts = [" ".join(m["content"] for m in e.messages[1:]) + " " + e.target for e in build_examples(0, 300) + build_examples(0, 100, "heldout")]
    corpus = set()
    for path in (ROOT / "examples/sample_corpus").iterdir():
        corpus |= _shingles(path.read_text(errors="ignore"), 8)
    questions = set()
    for line in (ROOT / "examples/sample_questions.jsonl").read_text().splitlines():
        questions |= _shingles(json.loads(line)["question"], 7)
    assert corpus and questions
    assert not set().union(*(_shingles(t, 8) for t in texts)) & corpus
    assert not set().union(*(_shingles(t, 7) for t in texts)) & questions
    module = importlib.import_module("eval.agents.tool_decisions")
    eval_tools = {t["function"]["name"] for tools in module.TOOLSETS.values() for t in tools}
    assert eval_tools and not eval_tools & set(CANONICAL) and set(CANONICAL) >= {f.name for f in FAMILIES}
    prompts = {
        json.loads(line)["prompt"]
        for name in ("tool_decisions.jsonl", "tool_decisions_b.jsonl")
        for line in (ROOT / "eval/agents/data" / name).read_text().splitlines()
        if line.strip()
    }
    assert not prompts & ({q for q, _ in NO_TOOL} | _user_texts(build_examples(0, 300)))


def test_qa_answers_cite_the_document_that_states_the_fact():
    for e in build_examples(1, 120, qa_share=1.0):
        documents = e.messages[-1]["content"]
        if e.kind == "qa_none":
            assert e.target.startswith("The documents do not say")
            continue
        cited = [int(n) for n in re.findall(r"\[(\d+)\]", e.target)]
        assert len(cited) == (2 if e.kind == "qa_two" else 1)
        blocks = re.split(r"\n\n(?=\[\d+\] )", documents.split("Documents:\n\n", 1)[1].rsplit("\n\nQuestion:", 1)[0])
        for sentence, number in zip(re.split(r"(?<=\]\.) ", e.target), cited):
            name = blocks[number - 1].split("\n", 1)[0].split("] ", 1)[1]
            assert name in sentence  # the cited document is the asked entity's, not a look-alike's


def test_described_questions_are_answered_inside_a_document_no_title_names():
    """Recipe 3: a third of single questions describe the entity ("the brewery in Quarrow"); the
    cited document is the one in that place, and an unanswerable one has no such document."""
    described = [e for e in build_examples(2, 200, qa_share=1.0) if e.template.endswith(":described")]
    assert {e.kind for e in described} == {"qa_one", "qa_none"}
    for e in described:
        asked = e.messages[-1]["content"].rsplit("Question: ", 1)[1]
        noun = DOMAIN_BY_KEY[e.domain].noun
        place = re.search(rf"the {noun} in ((?:[A-Z][a-z]+ ?)+)", asked).group(1).strip()
        blocks = re.split(r"\n\n(?=\[\d+\] )", e.messages[-1]["content"].split("Documents:\n\n", 1)[1].rsplit("\n\nQuestion:", 1)[0])
        titles = [b.split("\n", 1)[0].split("] ", 1)[1] for b in blocks]
        assert not any(t in asked for t in titles)  # no title is named in the question
        suffixes = DOMAIN_BY_KEY[e.domain].suffixes
        there = [i + 1 for i, b in enumerate(blocks) if place in b and titles[i].endswith(suffixes)]
        if e.kind == "qa_none":
            assert not there and e.target.endswith(f"in {place}.")
        else:
            assert there == [int(re.search(r"\[(\d+)\]", e.target).group(1))]


def test_encode_renders_as_the_engine_and_learns_only_the_answer(smollm_tok):
    from snapkv_rag.engine.prompts import render_prompt
    from snapkv_rag.tools import build_output_spec

    examples = build_examples(2, 12)
    assert any(e.segments for e in examples) and any(not e.segments for e in examples)
    for e in examples:
        enc = encode(e, smollm_tok)
        tools = build_output_spec(e.tools).tools if e.tools else ()
        prompt = [t for i, t in enumerate(enc.input_ids[0, : enc.prompt_tokens].tolist()) if i not in enc.anchors]  # the anchor copies taken out
        assert prompt == render_prompt(smollm_tok, e.messages, tools=tools)
        assert (enc.labels[0, : enc.prompt_tokens] == -100).all()
        assert smollm_tok.decode(enc.input_ids[0, enc.prompt_tokens :]) == e.target + smollm_tok.eos_token
        assert len(enc.spans) == len(enc.anchors) == len(e.segments)
        if e.segments:
            kept = [p for i, p in enumerate(enc.position_ids[0].tolist()) if i not in enc.anchors]
            assert kept == list(range(enc.tokens - len(enc.anchors)))
        for (start, end), segment in zip(enc.spans, e.segments):
            assert smollm_tok.decode(enc.input_ids[0, start:end]).strip() in segment


# --------------------------------------------------------------------------- block attention
def _reference_mask(length, spans, anchors):
    block = [-1] * length
    for i, (s, e) in enumerate(spans):
        for t in range(s, e):
            block[t] = i
    mask = torch.zeros(length, length, dtype=torch.bool)
    for q in range(length):
        for k in range(q + 1):
            if q in anchors:
                mask[q, k] = k == q
            elif block[q] >= 0:
                mask[q, k] = block[k] == block[q] or k == anchors[block[q]]
            else:
                mask[q, k] = k not in anchors
    return mask


@pytest.mark.parametrize("spans", [[], [(1, 4)], [(2, 5), (5, 9)], [(3, 6), (8, 12), (14, 15)]])
def test_block_mask_equals_a_reference(spans):
    ids, positions, moved, anchors = with_anchor_copies(list(range(100, 116)), spans)
    assert len(ids) == len(positions) == 16 + len(spans)
    assert [ids[a] for a in anchors] == [100] * len(spans) and [positions[a] for a in anchors] == [s - 1 for s, _ in spans]
    assert [ids[s:e] for s, e in moved] == [list(range(100 + s, 100 + e)) for s, e in spans]
    assert sorted(p for i, p in enumerate(positions) if i not in anchors) == list(range(16))
    assert torch.equal(block_attention_mask(len(ids), moved, anchors)[0, 0], _reference_mask(len(ids), moved, anchors))


@pytest.mark.parametrize("spans", [[(0, 3)], [(2, 5), (4, 6)], [(3, 20)], [(4, 4)]])
def test_anchor_copies_refuse_spans_they_cannot_mean(spans):
    with pytest.raises(ValueError):
        with_anchor_copies(list(range(16)), spans)


def test_a_block_read_apart_equals_that_chunk_computed_after_the_anchor_alone():
    """What chunk reuse stores (blending.compute_segment): a segment computed after the prompt's
    first token at positions 0, 1..m, later rotated into place; attention sees only distances."""
    model = tiny_model("llama", 300)
    original = torch.randint(3, 300, (20,)).tolist()
    ids, positions, spans, anchors = with_anchor_copies(original, [(3, 9), (9, 15)])
    mask, position_ids = block_attention_mask(len(ids), spans, anchors), torch.tensor([positions])
    with torch.no_grad():
        blocked = model(torch.tensor([ids]), attention_mask=mask, position_ids=position_ids).logits[0]
        for (start, end), (s0, e0) in zip(spans, [(3, 9), (9, 15)]):
            alone = model(torch.tensor([[original[0], *original[s0:e0]]])).logits[0, 1:]
            assert torch.allclose(blocked[start:end], alone, atol=1e-5)
        causal = model(torch.tensor([original])).logits[0]
        assert torch.allclose(blocked[:3], causal[:3], atol=1e-5)  # before the chunks: a normal prefill
        assert torch.allclose(causal, model(torch.tensor([original]), attention_mask=torch.ones(1, 1, 20, 20).tril().bool()).logits[0], atol=1e-5)
        # a chunk reads its own copy of the anchor (who else sees what is the reference mask's test)
        other = list(ids)
        other[anchors[1]] = 7
        changed = model(torch.tensor([other]), attention_mask=mask, position_ids=position_ids).logits[0]
    start, end = spans[1]
    assert not torch.allclose(changed[start:end], blocked[start:end], atol=1e-4)
    assert torch.allclose(changed[: anchors[1]], blocked[: anchors[1]], atol=1e-6)


# --------------------------------------------------------------------------- training
def _config(**kw):
    from snapkv_rag.adapter_training.train import TuneConfig

    settings = dict(model="", examples=8, accumulate=2, learning_rate=1e-2, warmup_steps=0, qa_share=0.0, eval_examples=0, rank=8, alpha=16, save_every=1)
    return TuneConfig(**{**settings, **kw})


def _mean_loss(model, encoded):
    from snapkv_rag.adapter_training.train import example_loss

    with torch.no_grad():
        return sum(float(example_loss(model, e)[0]) for e in encoded) / len(encoded)


def test_a_few_steps_on_a_tiny_model_lower_the_loss(smollm_tok, tmp_path):
    from snapkv_rag.adapter_training.train import tune

    torch.manual_seed(0)
    model = tiny_model("llama", len(smollm_tok))
    config = _config(examples=16, accumulate=1, learning_rate=0.1)
    seen = [encode(e, smollm_tok) for e in build_examples(config.seed, config.examples, qa_share=0.0)]
    before = _mean_loss(model, seen)
    state = tune(config, tmp_path, model=model, tokenizer=smollm_tok, progress=False)
    assert state["stopped"] is None and state["examples_done"] == 16
    # a random 64-wide model moves slowly under rank-8 LoRA (10.81 -> 10.66 when written); untrained, it stays at 10.81
    assert _mean_loss(model, seen) < before - 0.1
    rows = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 17)) and all(r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "loss.png").is_file()
    manifest = json.loads((tmp_path / "adapter/manifest.json").read_text())
    assert manifest["data"]["seed"] == 0 and manifest["training"]["examples_done"] == 16 and manifest["gates"] is None


def _adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_a_stopped_run_resumes_to_the_same_adapter(smollm_tok, tmp_path):
    from snapkv_rag.adapter_training.train import tune

    whole, split = tmp_path / "whole", tmp_path / "split"
    tune(_config(), whole, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    first = tune(_config(minutes=1e-9), split, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    assert first["stopped"].startswith("time limit") and first["examples_done"] == 2 and not (split / "adapter").exists()
    resumed = tune(_config(), split, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    assert resumed["stopped"] is None and resumed["examples_done"] == 8
    a, b = _adapter_tensors(whole / "adapter"), _adapter_tensors(split / "adapter")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert len((split / "loss.jsonl").read_text().splitlines()) == 4


def test_a_checkpoint_of_other_settings_is_refused(smollm_tok, tmp_path):
    from snapkv_rag.adapter_training.train import TuneError, tune

    tune(_config(minutes=1e-9), tmp_path, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    with pytest.raises(TuneError, match="rank"):
        tune(_config(rank=4), tmp_path, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)


@pytest.mark.parametrize("bad", [dict(examples=0), dict(learning_rate=2.0), dict(qa_share=1.5), dict(minutes=-1)])
def test_impossible_settings_get_one_clear_error(bad):
    from snapkv_rag.adapter_training.train import TuneError

    with pytest.raises(TuneError):
        _config(**bad).check()


# --------------------------------------------------------------------------- the adapter at load
@pytest.fixture(scope="module")
def trained_adapter(smollm_tok, tmp_path_factory):
    """A tiny model saved to disk and an adapter trained on it (with non-zero B: a few steps)."""
    from snapkv_rag.adapter_training.train import tune

    root = tmp_path_factory.mktemp("tuned")
    model = tiny_model("llama", len(smollm_tok))
    model.save_pretrained(root / "base")
    smollm_tok.save_pretrained(root / "base")
    tune(_config(examples=4), root / "run", model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    return root / "base", root / "run/adapter"


def test_merged_adapter_logits_equal_the_unmerged_ones(trained_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir = trained_adapter
    ids = torch.randint(3, 1000, (1, 24))
    with torch.no_grad():
        unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()(ids).logits
        bare = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        before = bare(ids).logits
        assert merge_adapter(bare, adapter_dir) == 14  # q, k, v, o, gate, up, down in 2 layers
        merged = bare(ids).logits
    assert torch.allclose(merged, unmerged, atol=1e-4)
    assert not torch.allclose(merged, before, atol=1e-3)


def test_the_engine_loads_an_adapter_and_says_so(trained_adapter):
    from snapkv_rag import Engine

    base_dir, adapter_dir = trained_adapter
    tuned = Engine.from_pretrained(str(base_dir), dtype="float32", adapter=str(adapter_dir))
    bare = Engine.from_pretrained(str(base_dir), dtype="float32")
    assert tuned.info().adapter == str(adapter_dir) and bare.info().adapter is None
    ids = torch.randint(3, 1000, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(tuned.model(ids).logits, bare.model(ids).logits, atol=1e-3)


def test_a_damaged_or_mismatched_adapter_is_refused(trained_adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir = trained_adapter
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with pytest.raises(AdapterError, match="needs adapter_config.json"):
        merge_adapter(model, tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes()[:100])
    with pytest.raises(AdapterError, match="could not read"):
        merge_adapter(model, broken)
    wider = tiny_model("llama", 500)
    wider.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 32, bias=False)
    with pytest.raises(AdapterError):
        merge_adapter(wider, adapter_dir)


def test_auto_uses_the_shipped_adapter_only_where_every_gate_passed(tmp_path, monkeypatch):
    from snapkv_rag.model import shipped_adapters as shipped

    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    directory = tmp_path / shipped.EMBEDDED_ADAPTER
    directory.mkdir()
    assert resolve_adapter("auto", embedded=True) is None  # no manifest
    (directory / "manifest.json").write_text(json.dumps({"gates": {"a": {"passed": True}, "b": {"passed": False}}}))
    assert resolve_adapter("auto", embedded=True) is None
    assert "missed its gates: b" in shipped.adapter_note("auto", embedded=True)
    (directory / "manifest.json").write_text(json.dumps({"gates": {"a": {"passed": True}, "b": {"passed": True}}}))
    assert resolve_adapter("auto", embedded=True) == directory
    assert resolve_adapter("auto", embedded=False) is None and resolve_adapter(None, embedded=True) is None
    assert resolve_adapter(str(tmp_path), embedded=True) == tmp_path


# --------------------------------------------------------------------------- command line
def test_tune_data_writes_the_examples(capsys, tmp_path):
    from snapkv_rag.adapter_training.dataset import token_counter
    from snapkv_rag.cli import main

    assert main(["tune", "data", "--examples", "3", "--seed", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # what training draws: budgets counted by the model's tokenizer
    assert [json.loads(line) for line in lines] == [e.to_dict() for e in build_examples(5, 3, count_tokens=token_counter(load_smollm_tokenizer()))]
    assert main(["tune", "data", "--examples", "2", "--split", "heldout", "--out", str(tmp_path / "h.jsonl")]) == 0
    assert len((tmp_path / "h.jsonl").read_text().splitlines()) == 2


def test_tune_train_reports_bad_settings_as_one_error(capsys, tmp_path):
    from snapkv_rag.cli import main

    assert main(["tune", "train", "--examples", "0", "--out", str(tmp_path)]) == 2
    assert "examples must be >= 1" in capsys.readouterr().err


def test_every_attribute_keeps_training_templates_beside_its_held_out_one():
    assert all(len(templates) >= 3 for templates in QUESTIONS.values())


def test_calls_name_the_tool_as_the_listing_offers_it():
    examples = [e for e in build_examples(0, 300, qa_share=0.0) if e.kind in ("tool_call", "tool_calls")]
    renamed = 0
    for e in examples:
        offered = {t["function"]["name"] for t in e.tools}
        for name in re.findall(r'"name": "([a-z_]+)"', e.target):
            assert name in offered
            renamed += name not in ALIASES
    assert renamed  # some calls use another name than the tool's own


def test_a_request_for_a_tool_not_offered_calls_nothing():
    from snapkv_rag.adapter_training.tool_data import FAMILY_BY_NAME, UNAVAILABLE

    unavailable = [e for e in build_examples(0, 400, qa_share=0.0) if e.kind == "tool_unavailable"]
    assert unavailable
    for e in unavailable:
        family = next(name for name in FAMILY_BY_NAME if e.template.startswith(f"tool:{name}:"))
        offered = {CANONICAL[t["function"]["name"]] for t in e.tools}
        assert e.target == UNAVAILABLE and family not in offered and "search_web" not in offered  # web search could still serve it


def test_the_manifest_command_trains_the_same_run():
    import shlex

    from snapkv_rag.adapter_training.cli import config_from_args
    from snapkv_rag.adapter_training.train import TuneConfig, train_command
    from snapkv_rag.cli import build_parser

    config = TuneConfig(examples=100, rank=8, learning_rate=3e-4, qa_share=0.5, dtype="float32")
    args = build_parser().parse_args(shlex.split(train_command(config))[1:])
    assert config_from_args(args).identity() == config.identity()


def test_a_shipped_adapter_is_half_the_bytes_and_merges_to_the_same_logits(trained_adapter, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from snapkv_rag.model import shipped_adapters as shipped

    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    base_dir, adapter_dir = trained_adapter
    target = shipped.ship_adapter(adapter_dir)
    shipped_manifest = json.loads((target / "manifest.json").read_text())
    assert shipped_manifest["gates"] is None and shipped_manifest["data"] == json.loads((adapter_dir / "manifest.json").read_text())["data"]
    assert (target / "adapter_model.safetensors").stat().st_size < 0.6 * (adapter_dir / "adapter_model.safetensors").stat().st_size
    ids = torch.randint(3, 1000, (1, 16))
    logits = []
    for directory in (adapter_dir, target):
        model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        merge_adapter(model, directory)
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-3)


def test_ctrl_c_finishes_the_step_then_checkpoints(smollm_tok, tmp_path):
    import os
    import signal

    from snapkv_rag.adapter_training.train import tune

    def interrupt(row):
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    state = tune(_config(), tmp_path, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False, on_step=interrupt)
    assert state["stopped"] == "SIGINT" and state["examples_done"] == 4
    saved = json.loads((tmp_path / "checkpoint/state.json").read_text())
    assert saved["step"] == 2 and saved["examples_done"] == 4 and not (tmp_path / "adapter").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_finished_run_is_not_trained_again(smollm_tok, tmp_path):
    from snapkv_rag.adapter_training.train import tune

    tune(_config(examples=2), tmp_path, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    manifest = tmp_path / "adapter/manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "gates": {"x": {"passed": True}}}))
    again = tune(_config(examples=2), tmp_path, model=tiny_model("llama", len(smollm_tok)), tokenizer=smollm_tok, progress=False)
    assert again["already_finished"] and json.loads(manifest.read_text())["gates"] == {"x": {"passed": True}}


def _gates_module():
    return importlib.import_module("eval.tune.tune_gates")


def _answer_rows(variant, right, size="1K", setting="full", n=10, gold=(1,), cited=(1,)):
    return [
        {"part": "answers", "variant": variant, "size": size, "setting": setting, "question": f"q{i}", "correct": i < right, "parts_correct": i < right,
         "gold": list(gold), "gold_f1": 1.0 if list(cited) == list(gold) else 0.0, "top2_gold_f1": 0.5, "adapter_sha256": variant}
        for i in range(n)
    ]  # fmt: skip


def test_the_gates_compare_like_with_like_and_fail_on_a_miss():
    gates = _gates_module()
    tools = lambda variant, right, false_calls: [  # noqa: E731
        {"part": "tools", "variant": variant, "prompt": f"p{i}", "tool": "t" if i < 5 else None, "right": i < right,
         "called": ["t"] if (i < 5 or i - 5 < false_calls) else [], "adapter_sha256": variant}
        for i in range(10)
    ]  # fmt: skip
    records = []
    for variant, right in (("base", 2), ("tuned", 8)):
        for size in ("1K", "2K", "4K"):
            records += _answer_rows(variant, right, size)
        records += _answer_rows(variant, right, "2K", "chunks r=0.15") + _answer_rows(variant, right, "2K", "snapkv 4x")
    assert gates.check_complete(records) == ["no tools records of the base variant", "no tools records of the tuned variant"]
    records += tools("base", 5, 1) + tools("tuned", 9, 1)
    assert gates.check_complete(records) == []
    result, _ = gates.gates(records)
    assert result["answers_1K"]["passed"] and result["answers_4K"]["passed"] and result["chunk_reuse_2K"]["passed"]
    assert result["citations_1K"]["passed"] and result["tool_decisions"]["passed"]
    worse = [r for r in records if not (r["variant"] == "tuned" and r.get("size") == "1K" and r.get("setting") == "full")] + _answer_rows("tuned", 6, "1K")
    assert not gates.gates(worse)[0]["answers_1K"]["passed"]  # 6 is base + 4
    fewer = [r for r in records if not (r["variant"] == "tuned" and r.get("question") == "q9" and r.get("size") == "4K")]
    assert "different questions" in gates.check_complete(fewer)[0]


def test_calls_write_arguments_in_the_schema_order_constrained_decoding_uses():
    calls = 0
    for e in build_examples(0, 400, qa_share=0.0):
        schemas = {t["function"]["name"]: list(t["function"]["parameters"]["properties"]) for t in e.tools}
        for block in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", e.target, re.S):
            call = json.loads(block)
            assert list(call["arguments"]) == [k for k in schemas[call["name"]] if k in call["arguments"]]
            calls += 1
    assert calls > 50


def test_no_generated_person_name_comes_from_the_eval_text():
    from snapkv_rag import lookalike_world as world

    corpus = (
        " ".join(p.read_text(errors="ignore") for p in (ROOT / "examples/sample_corpus").iterdir()) + (ROOT / "examples/sample_questions.jsonl").read_text()
    )
    assert not [n for n in world._GIVEN + world._FAMILY if re.search(rf"\b{re.escape(n)}\b", corpus)]


def test_less_kernels_and_chunk_stores_tell_a_tuned_model_from_its_base():
    """A merged adapter changes attention but not the embeddings LESS's digest reads."""
    from snapkv_rag.compression.less.kernels import model_signature, signature_mismatch
    from snapkv_rag.reuse.segment_store import model_signature as store_signature

    model = tiny_model("llama", 300)
    bare, bare_key = model_signature(model), store_signature(model)
    model.snapkv_adapter = "/somewhere/smollm2-135m-instruct"
    assert "adapter" in signature_mismatch(bare, model_signature(model))
    assert store_signature(model) != bare_key


def test_info_says_which_adapter_is_merged(trained_adapter, capsys):
    from snapkv_rag.cli import main

    base_dir, adapter_dir = trained_adapter
    assert main(["info", "--model", str(base_dir), "--dtype", "float32", "--adapter", str(adapter_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["adapter"] == str(adapter_dir.resolve())
    assert main(["info", "--model", str(base_dir), "--dtype", "float32", "--base-model"]) == 0
    assert "adapter: none (--base-model)" in capsys.readouterr().out
    assert main(["info", "--model", str(base_dir), "--adapter", str(base_dir)]) == 2  # a model directory is no adapter
    assert "is not a LoRA adapter" in capsys.readouterr().err


def test_gradient_checkpointing_trains_the_same_adapter(smollm_tok, tmp_path):
    """An 8B model does not fit training without it (issue 63); on the CPU it is off by default,
    and turned on it recomputes activations, so the adapter comes out the same."""
    from snapkv_rag.adapter_training.cli import config_from_args
    from snapkv_rag.adapter_training.train import tune

    adapters = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = tiny_model("llama", len(smollm_tok))
        tune(_config(examples=2, gradient_checkpointing=checkpointing), tmp_path / str(checkpointing), model=model, tokenizer=smollm_tok, progress=False)
        assert model.is_activation_checkpointing is checkpointing
        adapters.append(_adapter_tensors(tmp_path / str(checkpointing) / "adapter"))
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.allclose(adapters[0][k], adapters[1][k], atol=1e-6) for k in adapters[0])
    from snapkv_rag.cli import build_parser

    args = build_parser().parse_args(["tune", "train", "--gradient-checkpointing", "--attn-implementation", "sdpa"])
    config = config_from_args(args)
    assert config.gradient_checkpointing is True and config.attn_implementation == "sdpa"
    assert config_from_args(build_parser().parse_args(["tune", "train"])).gradient_checkpointing is None

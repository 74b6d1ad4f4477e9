"""The adapter rule: a shipped adapter is on for the uses it improves beyond the gates' noise."""

from __future__ import annotations

import json

import pytest

from snapkv_rag.model import shipped_adapters as shipped
from snapkv_rag.model.adapter_rule import applies_to, decide

# recipe 3's gates with the invariant mode on, and the noise of eval/tune/results/gate_noise
RECIPE3 = {
    "answers_1K": {"base": 27, "tuned": 30},
    "answers_2K": {"base": 18, "tuned": 26},
    "answers_4K": {"base": 11, "tuned": 26},
    "citations_1K": {"base": 0.0, "tuned": 0.56},
    "chunk_reuse_2K": {"base_lost": 12, "tuned_lost": 5},
    "snapkv_4x_2K": {"base_lost": 11, "tuned_lost": 7},
    "tool_decisions": {"base": 0.5, "tuned": 0.61, "base_false_calls": 0, "tuned_false_calls": 9},
}
NOISE = {
    "answers_1K": 2,
    "answers_2K": 1,
    "answers_4K": 0,
    "citations_1K": 0,
    "chunk_reuse_2K": 1,
    "snapkv_4x_2K": 1,
    "tool_decisions": 0,
    "tool_decisions.false_calls": 0,
}


def test_an_adapter_better_at_documents_and_worse_at_tools_is_on_for_documents_only():
    decisions = decide(RECIPE3, NOISE)
    assert decisions["documents"].applies and not decisions["tools"].applies
    assert decisions["tools"].worse == ["tool_decisions.false_calls"]
    assert "answers_4K" in decisions["documents"].better
    assert "worse beyond noise on tool_decisions.false_calls" in decisions["tools"].reason()


def test_a_loss_within_the_noise_does_not_count_and_one_beyond_it_does():
    gates = json.loads(json.dumps(RECIPE3))
    gates["answers_1K"]["tuned"] = 25  # 2 fewer than the base: within the 1K noise
    assert decide(gates, NOISE)["documents"].applies
    gates["answers_1K"]["tuned"] = 24  # 3 fewer: beyond it
    assert decide(gates, NOISE)["documents"].worse == ["answers_1K"]
    gates = json.loads(json.dumps(RECIPE3))
    for size in ("1K", "2K", "4K"):
        gates[f"answers_{size}"]["tuned"] = gates[f"answers_{size}"]["base"] + NOISE[f"answers_{size}"]  # better, but not beyond the noise
    decision = decide(gates, NOISE)["documents"]
    assert not decision.applies and decision.reason() == "better beyond noise on no headline measure"


def test_what_was_not_measured_keeps_the_adapter_off():
    noise = {k: v for k, v in NOISE.items() if k != "snapkv_4x_2K"}
    decision = decide(RECIPE3, noise)["documents"]
    assert not decision.applies and decision.unmeasured == ["snapkv_4x_2K"]
    gates = {k: v for k, v in RECIPE3.items() if k != "tool_decisions"}
    assert not decide(gates, NOISE)["tools"].applies


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path)
    directory = tmp_path / shipped.EMBEDDED_ADAPTER
    directory.mkdir()
    return directory


def test_auto_values_load_the_shipped_adapter_only_for_the_uses_it_is_on_for(shipped_dir):
    (shipped_dir / "manifest.json").write_text(json.dumps({"gates": RECIPE3, "applies_to": ["documents"], "rule": {"tools": "worse"}}))
    assert shipped.resolve_adapter("auto:documents", embedded=True) == shipped_dir
    assert shipped.resolve_adapter("auto", embedded=True) is None  # any use: tools too
    assert shipped.resolve_adapter("auto:tools", embedded=True) is None
    assert shipped.resolve_adapter("none", embedded=True) is None
    assert shipped.resolve_adapter("auto:documents", embedded=False) is None  # another model
    note = shipped.adapter_note("auto", embedded=True)
    assert "on only for documents" in note and "auto:documents" in note and "tools: worse" in note
    (shipped_dir / "manifest.json").write_text(json.dumps({"gates": RECIPE3, "applies_to": []}))
    assert shipped.resolve_adapter("auto:documents", embedded=True) is None
    assert "off for every use" in shipped.adapter_note("auto", embedded=True)


def test_an_older_manifest_is_on_everywhere_only_when_every_gate_passed():
    assert applies_to({"gates": {"a": {"passed": True}, "b": {"passed": True}}}) == ["documents", "tools"]
    assert applies_to({"gates": {"a": {"passed": True}, "b": {"passed": False}}}) == []
    assert applies_to({}) == []


def test_none_turns_the_adapter_off_from_every_command():
    from snapkv_rag.cli import build_parser

    assert shipped.adapter_option("none") is None and shipped.adapter_option("auto:documents") == "auto:documents"
    parser = build_parser()
    assert parser.parse_args(["ask", "q", "--collection", "c"]).adapter == "auto:documents"
    assert parser.parse_args(["info"]).adapter == "auto"
    from snapkv_rag.cli_common import chosen_adapter

    assert chosen_adapter(parser.parse_args(["ask", "q", "--collection", "c", "--adapter", "none"])) is None

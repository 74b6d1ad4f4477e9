"""The attack benchmark's in-process probes (eval/serving/attack.py, cases 16 and 17; issue 73): on
a tiny random model, another tenant's right guess of a victim's prompt gets what a wrong one gets,
from the Ray router (replica and X-SnapKV-Replica header) and from the call gate (reused K/V)."""

from __future__ import annotations

import pytest
from conftest import tiny_tool_engine

pytest.importorskip("ray.serve", reason="the routing probe runs the Ray router's policy (the 'ray' extra)")

from eval.serving.attack import Tenants, call_gate_probe, routing_probe  # noqa: E402

KEYS = [None, "victim-key"]  # a keyless server (the victim's own salt), a keyed one (two keys)


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer)


def without_guess(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "what"}


@pytest.mark.parametrize("api_key", KEYS)
def test_the_routing_probe_finds_a_right_guess_routed_as_a_wrong_one(engine, api_key):
    wrong, right, follow_up = routing_probe(engine, Tenants.of(api_key))
    assert "9999" in wrong["what"] and "4417" in right["what"]
    assert without_guess(right) == without_guess(wrong)  # replica, header, co-location with the victim
    assert right["header"] != right["replica"] if api_key else right["header"] == right["replica"]  # ids in the shared namespace only
    assert follow_up["with_victim"]  # affinity kept within the victim's namespace


@pytest.mark.parametrize("api_key", KEYS)
def test_the_call_gate_probe_finds_the_same_reuse_for_both_guesses(engine, api_key):
    engine.prefix_cache.clear()
    wrong, right = call_gate_probe(engine, Tenants.of(api_key))
    assert right["reused_prompt_tokens"] == wrong["reused_prompt_tokens"]
    assert engine.call_gate is None  # the probe leaves the engine's gate as it found it

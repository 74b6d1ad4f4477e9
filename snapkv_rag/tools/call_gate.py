"""Calibrated tool-call decisions under ``tool_choice="auto"`` (issue 28).

A small model offered tools in its system prompt rarely starts a call on its own: the embedded
135M model called none for 20 prompts that needed one. At the point where its reply could
begin with a call, the engine can decide instead:

1. score, by teacher forcing after the rendered prompt, the text that opens a call of each tool,
   ``<tool_call>\\n{"name": "<tool>"`` (its log-probability);
2. subtract each tool's mean score after a bank of requests that need no tool, rendered with the
   same tools (contextual calibration: a name the model likes after any request gains nothing);
3. call the best tool when its calibrated score plus ``marker_weight`` times the log-probability
   of the call marker's first token clears ``threshold``; else answer in prose, exactly as under
   ``tool_choice="none"`` (the tools are not rendered: with them in the prompt the embedded model
   answers a tool result by imitating tool-response blocks).

The call itself is then written under the grammar with the chosen tool forced, so its arguments
match the schema. The gate is opt-in (``engine.call_gate = CallGate(...)``): on the embedded
model a gate fitted on one tool set made 65-72% of the decisions on another set right (the
model alone: 50%, never calling), short of the 80% that would justify a default, and a gate that
never calls on one set's no-tool prompts called on others' (eval/agents/RESULTS.md, "Tool decisions
under tool_choice="auto""; ``eval/agents/tool_decisions.py`` fits and checks it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .calls import CALL_OPEN, OutputSpec

# Requests that need none of any tools: the background each tool's score is calibrated against.
BACKGROUND_REQUESTS = (
    "Hello.",
    "N/A",
    "Tell me something interesting.",
    "What do you think about that?",
    "Can you help me with something?",
    "Explain it in simple words.",
    "Write two sentences about anything.",
    "Thanks!",
)


@dataclass(frozen=True)
class CallGate:
    """Call the best tool when ``calibrated score + marker_weight * marker log-prob >= threshold``."""

    threshold: float
    marker_weight: float = 3.0


@dataclass(frozen=True)
class CallScores:
    marker: float  # log-probability of the call marker's first token where the reply begins
    tools: dict[str, float]  # log-probability of each tool's call opening


@dataclass(frozen=True)
class CallDecision:
    tool: str | None  # the tool to call, or None: answer in prose
    score: float  # the best tool's calibrated score plus the weighted marker log-probability
    threshold: float
    calibrated: dict[str, float]

    def to_dict(self) -> dict:
        calibrated = {k: round(v, 3) for k, v in self.calibrated.items()}
        return {"tool": self.tool, "score": round(self.score, 3), "threshold": self.threshold, "calibrated": calibrated}


def call_openings(tokenize: Callable[[str], list[int]], names: Sequence[str]) -> dict[str, list[int]]:
    """Token ids of each tool's call opening, ending with the name's closing quote (so a name is
    not scored as the prefix of a longer one)."""
    return {name: tokenize(CALL_OPEN + '{"name": ' + json.dumps(name)) for name in names}


def opening_log_probs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Per-token log-probabilities of ``ids`` from teacher-forced ``logits`` ``[len(ids), vocab]``."""
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(ids)), torch.tensor(ids)]


def decide(gate: CallGate, scores: CallScores, prior: dict[str, float]) -> CallDecision:
    calibrated = {name: value - prior[name] for name, value in scores.tools.items()}
    best = max(calibrated, key=lambda name: calibrated[name])
    score = calibrated[best] + gate.marker_weight * scores.marker
    return CallDecision(best if score >= gate.threshold else None, score, gate.threshold, calibrated)


def gated(spec: OutputSpec) -> bool:
    """A row whose reply may or may not start with a call: ``tool_choice="auto"`` with tools, no JSON format."""
    return spec.tool_choice == "auto" and bool(spec.tools) and spec.json_schema is None


def tools_key(spec: OutputSpec) -> str:
    """What a tool set's calibration depends on: the tools as rendered."""
    return json.dumps([t.to_openai() for t in spec.tools], sort_keys=True)

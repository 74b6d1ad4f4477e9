"""Whether a reply under ``tool_choice="auto"`` starts with a call, decided by a fitted
:class:`~snapkv_rag.tools.call_gate.CallGate` (opt-in, ``engine.call_gate``): each tool's call
opening scored by teacher forcing after the rendered prompt, against its mean score after
requests that need no tool (cached per tool set)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..tools.call_gate import BACKGROUND_REQUESTS, CallGate, CallScores, call_openings, decide, opening_log_probs, tools_key
from ..tools.calls import OutputSpec
from .prompts import render_prompt
from .requests import Request

MAX_CACHED_PRIORS = 64


class CallScorer:
    """``teacher_force(row, ids)``: the logits of ``ids`` after the rendered ``row``."""

    def __init__(self, tokenizer, teacher_force: Callable[[list[int], list[int]], torch.Tensor]):
        self.tokenizer = tokenizer
        self.teacher_force = teacher_force
        self.priors: dict[str, dict[str, float]] = {}

    def scores(self, row: list[int], spec: OutputSpec) -> CallScores:
        """Log-probabilities, after the rendered ``row``, of each tool's call opening and of the
        call marker's first token."""
        openings = call_openings(lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"], [t.name for t in spec.tools])
        tools, marker = {}, 0.0
        for name, ids in openings.items():
            log_probs = opening_log_probs(self.teacher_force(row, ids), ids)
            tools[name], marker = float(log_probs.sum()), float(log_probs[0])
        return CallScores(marker, tools)

    def prior(self, spec: OutputSpec) -> dict[str, float]:
        """Each tool's mean opening score after requests that need no tool, rendered with these tools (cached)."""
        key = tools_key(spec)
        prior = self.priors.get(key)
        if prior is None:
            rows = [render_prompt(self.tokenizer, text, tools=spec.tools) for text in BACKGROUND_REQUESTS]
            scores = [self.scores(row, spec).tools for row in rows]
            prior = {name: sum(s[name] for s in scores) / len(scores) for name in scores[0]}
            if len(self.priors) >= MAX_CACHED_PRIORS:
                self.priors.pop(next(iter(self.priors)))
            self.priors[key] = prior
        return prior

    def decided(self, request: Request, gate: CallGate) -> Request:
        """The request again, with tool_choice forced to the gate's tool or "none" (prose)."""
        assert request.redo is not None
        spec = request.specs[0]
        decision = decide(gate, self.scores(request.rows[0], spec), self.prior(spec))
        choice = {"type": "function", "function": {"name": decision.tool}} if decision.tool else "none"
        return replace(request.redo(choice), call_decision=decision)

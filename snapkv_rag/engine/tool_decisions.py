"""Whether a reply under ``tool_choice="auto"`` starts with a call, decided by a fitted
:class:`~snapkv_rag.tools.call_gate.CallGate` (opt-in, ``engine.call_gate``): each tool's call
opening scored by teacher forcing after the rendered prompt, against its mean score after
requests that need no tool (cached per tool set). Both read and store prompt K/V in the
request's prefix-cache namespace (its ``cache_salt``; the server's tenant) and cache the means
per namespace, so one tenant's decisions, and their time, tell nothing of another's prompts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..tools.call_gate import BACKGROUND_REQUESTS, CallGate, CallScores, call_openings, decide, opening_log_probs, tools_key
from ..tools.calls import OutputSpec
from .prompts import render_prompt
from .requests import Request

MAX_CACHED_PRIORS = 64


@dataclass(frozen=True)
class CacheUse:
    """The prefix cache as a request may use it: at all (``prefix_cache=``), and in which namespace."""

    enabled: bool = True
    namespace: str = ""

    @classmethod
    def of(cls, request: Request) -> CacheUse:
        return cls(request.use_prefix_cache, request.cache_salt or "")


class TeacherForce(Protocol):
    def __call__(self, row: list[int], ids: list[int], *, prefix_cache: bool, namespace: str) -> torch.Tensor: ...


class CallScorer:
    """``teacher_force(row, ids, prefix_cache=, namespace=)``: the logits of ``ids`` after the rendered ``row``."""

    def __init__(self, tokenizer, teacher_force: TeacherForce):
        self.tokenizer = tokenizer
        self.teacher_force = teacher_force
        self.priors: dict[tuple[str, str], dict[str, float]] = {}  # (namespace, tool set) -> prior

    def scores(self, row: list[int], spec: OutputSpec, cache: CacheUse = CacheUse()) -> CallScores:
        """Log-probabilities, after the rendered ``row``, of each tool's call opening and of the
        call marker's first token."""
        openings = call_openings(lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"], [t.name for t in spec.tools])
        tools, marker = {}, 0.0
        for name, ids in openings.items():
            logits = self.teacher_force(row, ids, prefix_cache=cache.enabled, namespace=cache.namespace)
            log_probs = opening_log_probs(logits, ids)
            tools[name], marker = float(log_probs.sum()), float(log_probs[0])
        return CallScores(marker, tools)

    def prior(self, spec: OutputSpec, cache: CacheUse = CacheUse()) -> dict[str, float]:
        """Each tool's mean opening score after requests that need no tool, rendered with these
        tools (cached per namespace: a hit would tell that another tenant used this tool set)."""
        key = (cache.namespace, tools_key(spec))
        prior = self.priors.get(key)
        if prior is None:
            rows = [render_prompt(self.tokenizer, text, tools=spec.tools) for text in BACKGROUND_REQUESTS]
            scores = [self.scores(row, spec, cache).tools for row in rows]
            prior = {name: sum(s[name] for s in scores) / len(scores) for name in scores[0]}
            if len(self.priors) >= MAX_CACHED_PRIORS:
                self.priors.pop(next(iter(self.priors)))
            self.priors[key] = prior
        return prior

    def decided(self, request: Request, gate: CallGate) -> Request:
        """The request again, with tool_choice forced to the gate's tool or "none" (prose)."""
        assert request.redo is not None
        spec, cache = request.specs[0], CacheUse.of(request)
        decision = decide(gate, self.scores(request.rows[0], spec, cache), self.prior(spec, cache))
        choice = {"type": "function", "function": {"name": decision.tool}} if decision.tool else "none"
        return replace(request.redo(choice), call_decision=decision)

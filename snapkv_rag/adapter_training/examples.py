"""One training example: the messages (and tools) exactly as inference renders them, the
assistant text to learn, and the stuffed segments to read apart under block attention."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    kind: str  # "qa_one", "qa_two", "qa_none", "qa_read", "tool_near_miss", "tool_call", "tool_calls", "tool_none", "tool_answer"
    messages: list[dict[str, Any]]
    target: str  # what the assistant writes next
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-style function tools offered
    segments: list[str] = field(default_factory=list)  # stuffed chunks read apart (block attention); empty: causal
    domain: str = ""  # QA: the gold entity's domain; tools: the needed tool (or "none")
    template: str = ""  # which question or request template wrote the user turn
    read: str = ""  # recipe 4: the compression spec the prompt is read under (snapkv_rag.adapter_training.compressed_reads); empty: the full cache

    def to_dict(self) -> dict[str, Any]:
        read = {"read": self.read} if self.read else {}  # absent when empty: recipe 3's data keeps its fingerprint
        return {
            "kind": self.kind,
            "messages": self.messages,
            "target": self.target,
            "tools": self.tools,
            "segments": self.segments,
            "domain": self.domain,
            "template": self.template,
        } | read

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Example:
        return cls(**data)

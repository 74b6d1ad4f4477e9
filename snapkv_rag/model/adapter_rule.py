"""Where a shipped adapter is on by default: the uses whose held-out measures it improves.

An adapter trained on the toolkit's jobs can win at one and lose at another (recipe 3 answers
documents better and calls tools where none is needed). So the rule is per use:

- ``documents`` (``ask`` and the app load it for this use, ``adapter="auto:documents"``): answers
  right at 1K, 2K and 4K stuffed tokens (the headline), own citations, answers lost to chunk
  reuse and to SnapKV 4x;
- ``tools`` (agents under ``tool_choice="auto"``): tool decisions right (the headline) and false
  calls on requests that need no tool. ``adapter="auto"``, the default elsewhere (the server,
  chat, the connectors serve both), needs both.

An adapter applies to a use when it is better than the bare model on at least one headline
measure by more than that measure's noise, and worse on none by more than its noise. The noise
is measured, not assumed: the largest change of the measure between two runs of one model
(another prefix-cache history, the invariant mode on and off; ``python -m eval gate_noise``).
"""

from __future__ import annotations

from dataclasses import dataclass

USES = ("documents", "tools")
# the ``adapter=`` values that ask for the shipped adapter (snapkv_rag.model.shipped_adapters); here,
# torch-free, so the command line's parsers can name them without loading torch
AUTO = "auto"
AUTO_DOCUMENTS = "auto:documents"
AUTO_TOOLS = "auto:tools"
AUTOS = (AUTO, AUTO_DOCUMENTS, AUTO_TOOLS)
NONE = "none"


@dataclass(frozen=True)
class Measure:
    gate: str  # the gate's key in the manifest's ``gates``
    use: str
    base_key: str
    tuned_key: str
    higher_is_better: bool
    headline: bool = False


MEASURES: tuple[Measure, ...] = (
    Measure("answers_1K", "documents", "base", "tuned", True, headline=True),
    Measure("answers_2K", "documents", "base", "tuned", True, headline=True),
    Measure("answers_4K", "documents", "base", "tuned", True, headline=True),
    Measure("citations_1K", "documents", "base", "tuned", True),
    Measure("chunk_reuse_2K", "documents", "base_lost", "tuned_lost", False),
    Measure("snapkv_4x_2K", "documents", "base_lost", "tuned_lost", False),
    Measure("tool_decisions", "tools", "base", "tuned", True, headline=True),
    Measure("tool_decisions", "tools", "base_false_calls", "tuned_false_calls", False),
)


def noise_key(measure: Measure) -> str:
    return measure.gate if measure.base_key in ("base", "base_lost") else f"{measure.gate}.{measure.base_key.removeprefix('base_')}"


@dataclass(frozen=True)
class UseDecision:
    use: str
    applies: bool
    better: list[str]  # headline measures better beyond noise
    worse: list[str]  # measures worse beyond noise
    unmeasured: list[str]

    def reason(self) -> str:
        if self.unmeasured:
            return f"not measured: {', '.join(self.unmeasured)}"
        if self.worse:
            return f"worse beyond noise on {', '.join(self.worse)}"
        if not self.better:
            return "better beyond noise on no headline measure"
        return f"better on {', '.join(self.better)}, worse beyond noise on none"


def decide(gates: dict, noise: dict[str, float]) -> dict[str, UseDecision]:
    """Each use's decision from a manifest's ``gates`` and the measured ``noise`` (by :func:`noise_key`;
    a measure without a noise figure counts as unmeasured)."""
    decisions = {}
    for use in USES:
        better, worse, unmeasured = [], [], []
        for m in (m for m in MEASURES if m.use == use):
            key = noise_key(m)
            gate = gates.get(m.gate) or {}
            if m.base_key not in gate or m.tuned_key not in gate or key not in noise:
                unmeasured.append(key)
                continue
            gain = (gate[m.tuned_key] - gate[m.base_key]) * (1 if m.higher_is_better else -1)
            if gain < -noise[key]:
                worse.append(key)
            elif gain > noise[key] and m.headline:
                better.append(key)
        decisions[use] = UseDecision(use, not unmeasured and not worse and bool(better), better, worse, unmeasured)
    return decisions


def applies_to(manifest: dict) -> list[str]:
    """The uses a shipped adapter's manifest says it is on for: its ``applies_to`` when written by the
    gates with their noise, else every use when every absolute gate passed (an older manifest)."""
    if isinstance(manifest.get("applies_to"), list):
        return [u for u in manifest["applies_to"] if u in USES]
    return list(USES) if gates_passed(manifest) else []


def gates_passed(manifest: dict) -> bool:
    """Whether every absolute gate of an older manifest passed."""
    gates = manifest.get("gates") or {}
    return bool(gates) and all(g.get("passed") is True for g in gates.values())

"""The one default compression: what every interface reads a prompt with when the caller names none.

The CLI (``ask``, ``generate``, ``chat``), :class:`~snapkv_rag.rag.qa.DocumentQA`, the server, the app
and both connectors take this object; ``snapkv-rag info`` and ``/v1/models`` print its spec. The spec
``"default"`` names it. SnapKV at 1,024 entries per layer, voting with the question's own tokens
(eval/compression/RESULTS.md, "SnapKV sensitivity"), in 16-token spans for prompts of at least twice
the budget (a shallower cut selects token by token). Prompts of at most 1,024 tokens keep everything.
"""

from __future__ import annotations

from .snapkv import SnapKV

DEFAULT_SPEC = "default"
# Question-aligned observation window (the question plus the template tail, 8-64 tokens) and,
# where the prompt is at least twice the budget, 16-token spans (eval/compression/RESULTS.md, "Selection
# options against answers"): over 40 questions at 2K and 4K stuffed tokens, 4x and 8x, spans of
# 16 lost 35 right answers against 46 for token-level top-k; at 1.03x and 1.5x they lost one
# more each (2 against 1, 1 against 0), so shallow cuts stay token-level.
DEFAULT_COMPRESSION = SnapKV(window_size="question", max_capacity_prompt=1024, chunk_size=16, chunk_min_ratio=2)

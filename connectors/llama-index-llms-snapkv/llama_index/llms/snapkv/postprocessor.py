"""``TokenBudgetPostprocessor``: keep as many retrieved nodes as fit the LLM's token budget.

The packing is :func:`snapkv_rag.integrations.pack_greedy`, the same packer the RAG core's
``StuffingRetriever`` uses: nodes in rank order, each costed in the *LLM's* tokens (its
header and separator included), taken while they fit, so the query engine's synthesizer
sends one prompt instead of refining over several.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from snapkv_rag.integrations import ContextBudgetError, offer_segments, pack_greedy

#: CitationQueryEngine numbers its sources like this; pass it as ``node_header`` there.
CITATION_HEADER = "Source {n}:\n"


class TokenBudgetPostprocessor(BaseNodePostprocessor):
    """Keep the best-ranked nodes that fit ``context_tokens`` LLM tokens (default: what the LLM leaves).

    ``llm``: a :class:`~llama_index.llms.snapkv.SnapKVLLM` (or any LLM given with ``count_tokens``).
    ``context_tokens``: tokens for the nodes' text; default ``context_window - num_output -
    reserve_tokens - tokens of the query``. ``reserve_tokens`` covers the query engine's
    prompt template and the chat template (LlamaIndex's default QA template is about 100
    tokens, CitationQueryEngine's about 400 on SmolLM2's tokenizer). ``node_header``: text put
    before each node by the prompt, formatted with ``n`` (e.g. :data:`CITATION_HEADER`).
    ``metadata_mode``: how the node's text is rendered for the LLM (its
    ``excluded_llm_metadata_keys`` apply). ``last_report`` describes the latest packing.
    """

    llm: Any = Field(exclude=True, description="The LLM whose tokens and context count.")
    context_tokens: int | None = Field(default=None, gt=0)
    reserve_tokens: int = Field(default=512, ge=0)
    node_header: str = Field(default="")
    separator: str = Field(default="\n\n")
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM)
    count_tokens: Callable[[str], int] | None = Field(default=None, exclude=True)

    _last: dict[str, Any] | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "TokenBudgetPostprocessor"

    def _count(self, text: str) -> int:
        count = self.count_tokens or getattr(self.llm, "count_tokens", None)
        if count is None:
            raise ValueError("give count_tokens= or an LLM with count_tokens (such as SnapKVLLM)")
        return count(text)

    def budget(self, query_str: str | None = None) -> int:
        """Tokens available for the nodes of a query."""
        if self.context_tokens is not None:
            return self.context_tokens
        meta = self.llm.metadata
        query = self._count(query_str) if query_str else 0
        room = meta.context_window - meta.num_output - self.reserve_tokens - query
        if room <= 0:
            raise ContextBudgetError(
                f"no room for nodes: context_window {meta.context_window} - num_output {meta.num_output} - "
                f"reserve_tokens {self.reserve_tokens} - query {query} = {room}"
            )
        return room

    @property
    def last_report(self) -> dict[str, Any] | None:
        return self._last

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        budget = self.budget(query_bundle.query_str if query_bundle is not None else None)
        texts = [n.node.get_content(metadata_mode=self.metadata_mode) for n in nodes]
        packing = pack_greedy(len(nodes), lambda i, slot: self._count(self.separator + self.node_header.format(n=slot) + texts[i]), budget)
        self._last = {
            "candidates": len(nodes),
            "kept": len(packing.kept),
            "left_out": len(packing.left_out),
            "budget_tokens": budget,
            "used_tokens": packing.used,
            "left_out_tokens": sum(packing.costs.get(i) or self._count(self.separator + texts[i]) for i in packing.left_out),
        }
        # SnapKVLLM(kv_reuse="chunks") reuses the kept nodes' K/V wherever the synthesizer puts them
        offer_segments(texts[i] for i in packing.kept)
        return [nodes[i] for i in packing.kept]

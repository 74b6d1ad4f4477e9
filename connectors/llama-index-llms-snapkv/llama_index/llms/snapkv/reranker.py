"""``SnapKVAttentionReranker``: rerank retrieved nodes by the model's own attention.

The ranking is :func:`snapkv_rag.integrations.attention_rerank`: the nodes' texts are stuffed as
numbered documents after the query, read once (a prefill that stops after the deepest layer the
scoring heads are in, no token generated) and each node is scored by its share of the query's
attention on the documents. This module only translates nodes to texts and back.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
from llama_index.core.callbacks import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.rerank import ReRankEndEvent, ReRankStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from snapkv_rag.integrations import Reranked, as_policy, attention_rerank, shared_engine

dispatcher = get_dispatcher(__name__)

#: The metadata keys the reranker writes; kept out of the LLM's and the embedder's text.
RERANK_METADATA_KEYS = ("attention_score", "attention_rank", "retrieval_score")


class SnapKVAttentionReranker(BaseNodePostprocessor):
    """Reorder nodes by the share of the query's attention each gets from the model (best first).

    ``llm``: a :class:`~llama_index.llms.snapkv.SnapKVLLM` whose engine reads the nodes, or
    ``engine``: a :class:`snapkv_rag.Engine` (neither: the embedded model's shared engine).
    ``top_n``: keep the best this many (None: all). ``budget_tokens``: then keep the best that fit
    this many of the model's tokens, each node counted as it would be stuffed (its ``[n]`` label
    included). ``fusion``: ``"attention"`` alone, or ``"rrf"`` (reciprocal-rank fusion with the
    retriever's order). ``heads``: ``"auto"`` (the heads shipped for the model, else every head of
    the middle layers), None (every head of the middle layers) or (layer, head) pairs.
    ``compression``: the policy of the read (default: the toolkit's default); it needs an
    observation window, so ``None``/``"full"`` is an error. ``metadata_mode``: how a node's text is
    rendered for the read (its ``excluded_llm_metadata_keys`` apply). ``stored_keys``: skim from
    the engine's stored keys (its ``segment_store``): a node's text seen for an earlier query is
    placed from its stored K/V instead of read again (the first time it is computed and stored).

    Each returned node's ``score`` is its attention share (the shares of all input nodes sum to 1);
    its metadata gains ``attention_score``, ``attention_rank`` (1-based among all input nodes) and
    the retriever's ``retrieval_score`` when it had one, all excluded from the LLM's and the
    embedder's text. Nodes are copied, the input nodes are left as they were.
    ``last_rerank`` is the latest :class:`snapkv_rag.integrations.Reranked` (``seconds``,
    ``prompt_tokens``).
    """

    llm: Any = Field(default=None, exclude=True, description="A SnapKVLLM whose engine reads the nodes.")
    engine: Any = Field(default=None, exclude=True, description="A snapkv_rag.Engine (instead of llm).")
    top_n: int | None = Field(default=None, gt=0, description="Keep the best this many nodes (None: all).")
    budget_tokens: int | None = Field(default=None, gt=0, description="Then keep the best that fit this many model tokens.")
    fusion: Literal["attention", "rrf"] = Field(default="attention", description="'attention' alone or 'rrf' with the retriever's order.")
    heads: Any = Field(default="auto", description="'auto', None (the middle layers' heads) or (layer, head) pairs.")
    compression: Any = Field(default="default", description="Policy or spec string of the read; needs an observation window.")
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="How a node's text is rendered for the read.")
    stored_keys: bool = Field(default=False, description="Skim from the engine's stored K/V: a text seen before is not read again.")

    _last: Reranked | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> SnapKVAttentionReranker:
        if self.llm is not None and self.engine is not None:
            raise ValueError("give llm= or engine=, not both")
        if self.llm is not None and getattr(self.llm, "engine", None) is None:
            raise TypeError(f"llm must be a SnapKVLLM (an LLM with an .engine), got {type(self.llm).__name__}")
        if as_policy(self.compression) is None:  # an invalid spec fails here, not at the first query
            raise ValueError("the reranker reads with a compression policy that has an observation window; compression=None/'full' has none")
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SnapKVAttentionReranker"

    @property
    def last_rerank(self) -> Reranked | None:
        return self._last

    def _engine(self) -> Any:
        if self.engine is not None:
            return self.engine
        if self.llm is not None:
            return self.llm.engine
        return shared_engine("default")

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        if query_bundle is None or not query_bundle.query_str.strip():
            raise ValueError("SnapKVAttentionReranker ranks nodes for a query: pass query_bundle= or query_str= to postprocess_nodes")
        if not nodes:
            return []
        engine = self._engine()
        texts = [n.node.get_content(metadata_mode=self.metadata_mode) for n in nodes]
        dispatcher.event(ReRankStartEvent(query=query_bundle, nodes=nodes, top_n=self.top_n or len(nodes), model_name=engine.name))
        payload = {
            EventPayload.NODES: nodes,
            EventPayload.MODEL_NAME: engine.name,
            EventPayload.QUERY_STR: query_bundle.query_str,
            EventPayload.TOP_K: self.top_n,
        }
        with self.callback_manager.event(CBEventType.RERANKING, payload=payload) as event:
            reranked = attention_rerank(
                engine,
                query_bundle.query_str,
                texts,
                budget_tokens=self.budget_tokens,
                compression=self.compression,
                heads=self.heads,
                fusion=self.fusion,
                stored_keys=True if self.stored_keys else None,
            )
            self._last = reranked
            chosen = reranked.chosen(self.top_n)
            ranks = reranked.ranks
            out = [self._scored(nodes[i], reranked.scores[i], ranks[i]) for i in chosen]
            event.on_end(payload={EventPayload.NODES: out})
        dispatcher.event(ReRankEndEvent(nodes=out))
        return out

    @staticmethod
    def _scored(node: NodeWithScore, score: float, rank: int) -> NodeWithScore:
        metadata = {**node.node.metadata, "attention_score": score, "attention_rank": rank}
        if node.score is not None:
            metadata["retrieval_score"] = node.score
        hidden = [k for k in RERANK_METADATA_KEYS if k in metadata]
        update = {
            "metadata": metadata,
            "excluded_llm_metadata_keys": [*node.node.excluded_llm_metadata_keys, *(k for k in hidden if k not in node.node.excluded_llm_metadata_keys)],
            "excluded_embed_metadata_keys": [*node.node.excluded_embed_metadata_keys, *(k for k in hidden if k not in node.node.excluded_embed_metadata_keys)],
        }
        return NodeWithScore(node=node.node.model_copy(update=update), score=score)

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        # the read is a prefill on the engine's worker: run it off the event loop
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)

"""Prompt K/V computed once and used again: the exact prefix cache (``prefix_cache.py``), chunk
K/V moved into new prompts (``blending.py``), where chunk K/V are stored (``segment_store.py``)
and the texts retrievers and memories offer for reuse (``offered.py``)."""

"""LESS (Dong et al., ICML 2024): a learned low-rank state over what a sparse policy evicts.

- :mod:`.kernels`: the feature maps, their safetensors files and the shipped ones;
- :mod:`.state`: the per-run state, folding and attention with it;
- :mod:`.train`: ``snapkv-rag less train`` (stage 1: each layer alone, on the full model's activations);
- :mod:`.distill`: stage 2, every layer together on the end-to-end KL (``snapkv-rag less distill``).

The policy wrapper is :class:`snapkv_rag.compression.LESS` (spec ``less:base=snapkv,budget=256``).
"""

"""Training LESS kernels (Dong et al., ICML 2024), the learned low-rank state over what a sparse
policy evicts, and fitting them to a collection. The runtime that uses them is
:mod:`snapkv_rag.compression.less`; LoRA fine-tuning of the model itself is :mod:`snapkv_rag.adapter_training`.

- :mod:`.corpus`: the offline training and held-out texts;
- :mod:`.train`: ``snapkv-rag less train`` (stage 1: each layer alone, on the full model's activations);
- :mod:`.distill`: stage 2, every layer together on the end-to-end KL (``snapkv-rag less distill``);
- :mod:`.calibrate`: ``snapkv-rag less calibrate``, kernels fitted to one collection;
- :mod:`.gap`: ``snapkv-rag less gap``, where the remaining gap to the full cache sits.
"""

"""The model the engine runs: loading (``loading.py``), CPU weight layouts (``packed_linear.py``,
``quantization.py``), OpenMP threads (``openmp.py``) and peak-memory probes (``peak_memory.py``)."""

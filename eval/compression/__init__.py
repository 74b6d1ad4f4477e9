"""Compression benchmarks: SnapKV's selection and its options against baselines, decode-time cuts,
rolling prefill, fewer bits per entry (kv_bits), LESS, and the harness runs (needle, speed,
fidelity) behind them. Results: RESULTS.md beside this file."""

"""Decoding-speed benchmarks: bf16 against fp32 (fidelity and answers), weight-only int8, packed
and fused weights, the decode attention path, prompt-lookup drafts and the llama.cpp comparison.
Results: RESULTS.md beside this file."""

"""The tuned embedded model's gates: the LoRA adapter against the bare model on answers, citations,
chunk reuse, compression and tool decisions. Results: RESULTS.md beside this file."""

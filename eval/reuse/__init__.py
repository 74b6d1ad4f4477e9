"""Reuse benchmarks: the prefix cache (whole prompts, any share of one, chunks ordered for reuse)
and chunk-level K/V reuse. Results: RESULTS.md beside this file."""

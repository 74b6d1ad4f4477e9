"""Document-QA benchmarks: how many stuffed tokens the embedded model answers from, and the
citations (attribution, "not supported", the run's own attention). Results: RESULTS.md beside this file."""

"""Serving benchmarks: what the OpenAI-compatible server adds to a request, its memory over a soak,
continuous batching with many clients, and replicas on Ray Serve. Results: RESULTS.md beside this file."""

"""The one prepared check for a GPU machine (issue 63): versions, CUDA against the CPU, decode speed
against its bandwidth floor, memory, rolling prefill, reuse, concurrency and training, each part under
a time limit. Its tiny mode runs on a CPU in CI. Results: RESULTS.md beside this file."""

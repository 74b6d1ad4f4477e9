"""What several benchmarks share: how results are written (``results_io``), the corpora they ask
questions over (``corpora``) and how a benchmark runs itself in a child process (``processes``)."""

"""``python -m eval``: list, run or dry-run the benchmarks (see :func:`eval.run`)."""

import sys

from eval import run

raise SystemExit(run(sys.argv[1:]))

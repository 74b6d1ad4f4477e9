#!/usr/bin/env bash
# Lint and type-check (config in pyproject.toml): ruff (pyflakes, pycodestyle, isort, bugbear,
# pyupgrade), ruff's formatter, and mypy on snapkv_rag/. Run by scripts/test.sh; needs scripts/setup.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
rc=0
.venv/bin/ruff check . || rc=1
.venv/bin/ruff format --check . || rc=1
.venv/bin/mypy || rc=1
exit "$rc"

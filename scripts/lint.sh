#!/usr/bin/env bash
# Lint and type-check (config in pyproject.toml): ruff (pyflakes, pycodestyle, isort, bugbear,
# pyupgrade), ruff's formatter, mypy on snapkv_rag/, and the docs site (mkdocs build --strict). Run by scripts/test.sh; needs scripts/setup.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
rc=0
.venv/bin/ruff check . || rc=1
.venv/bin/ruff format --check . || rc=1
.venv/bin/mypy || rc=1
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)" || rc=1
exit "$rc"

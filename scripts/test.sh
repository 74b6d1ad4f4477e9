#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Fails when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# The app's browser test drives Debian's chromium through chromedriver; install them when missing (root only).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } || echo "warning: could not install chromium; the browser test will fail" >&2
  else
    echo "note: chromium/chromedriver missing and not root; the app's browser test is skipped" >&2
  fi
fi
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  export SNAPKV_RAG_REQUIRE_BROWSER=1
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
# Lint and types too (a whole run only: arguments select tests, and then lint is skipped).
if [ "$#" -eq 0 ]; then
  echo "lint: ruff and mypy" >&2
  bash scripts/lint.sh || { echo "error: lint or type check failed (bash scripts/lint.sh)" >&2; [ "$rc" -eq 0 ] && rc=1; }
fi
exit "$rc"

#!/usr/bin/env bash
# Set up (scripts/setup.sh, idempotent) and run the main job on the embedded model, offline:
# ingest the sample corpus into an embedded Chroma store, then answer a question with SnapKV
# and citations. Extra arguments go to `snapkv-rag ask` (e.g. --context-tokens 4000 --json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/snapkv-rag ingest examples/sample_corpus --collection marrowick
.venv/bin/snapkv-rag ask "What time does the first ferry leave Marrowick harbour on weekdays?" --collection marrowick "$@"

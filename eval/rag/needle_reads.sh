#!/usr/bin/env bash
# Needles at 16K and 32K, 15 depths, read in one pass and skimmed, then the sample corpus skimmed
# whole (issue 66): the runs behind eval/rag/RESULTS.md's "Needles skimmed" section, one queue on
# two threads (about 70 minutes here). Resumable: a rerun skips the records already written.
#   bash eval/rag/needle_reads.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
$PY -m eval needle_reads --wordings passkey
$PY -m eval needle_reads --wordings code --readings rolled docs-skim:whole\>1K
$PY -m eval long_reads --corpus sample --readings skim:whole\>1K
$PY -m eval long_reads --corpus sample --adapter snapkv_rag/tune/shipped/smollm2-135m-instruct --label recipe3 --readings skim:whole\>1K

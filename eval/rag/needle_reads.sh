#!/usr/bin/env bash
# Issue 66's skim measurements, the runs behind eval/rag/RESULTS.md's "Needles skimmed" and the
# look-alike rows of this session: the pass key at 15 depths of 16K and 32K skimmed then read; the
# sample corpus skimmed whole with the adapter `ask` puts on for documents; the look-alike corpus
# re-read in 500 tokens, and read by the shipped adapter; the door-code needle (a wording used
# nowhere else) in one rolled pass and skimmed. One queue on two threads, about 2.5 hours here;
# resumable: a rerun skips the records already written.
#   bash eval/rag/needle_reads.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
SHIPPED=snapkv_rag/adapter_training/shipped/smollm2-135m-instruct
$PY -m eval needle_reads --wordings passkey --readings docs-skim:whole\>1K
$PY -m eval long_reads --corpus sample --adapter $SHIPPED --label recipe3 --readings skim:whole\>1K
$PY -m eval long_reads --corpus lookalike --readings skim:8K\>0.5K
$PY -m eval long_reads --corpus lookalike --adapter $SHIPPED --label recipe3 --readings full:1K skim:8K\>1K
$PY -m eval needle_reads --wordings code --lengths 16384 --readings rolled docs-skim:whole\>1K
$PY -m eval needle_reads --wordings code --lengths 32768 --readings docs-skim:whole\>1K rolled
$PY -m eval needle_reads --wordings passkey --readings rolled

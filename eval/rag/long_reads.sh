#!/usr/bin/env bash
# Long reads (issue 66), the runs behind eval/rag/RESULTS.md's section: the recipe-4 adapter and the
# base model on the look-alike corpus, recipe 4's gates, and the shipped adapter (recipe 3) on the
# sample corpus stuffed whole; two queues at once, one core and one thread each (about 90 minutes
# here). Resumable: a rerun skips the records already written.
#   ADAPTER4=tune-runs/smollm2-recipe4/adapter bash eval/rag/long_reads.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ADAPTER4=${ADAPTER4:-tune-runs/smollm2-recipe4/adapter}
LOGS=${LOGS:-eval/rag/results/long_reads_logs}
mkdir -p "$LOGS"
run() { OMP_NUM_THREADS=1 taskset -c "$1" .venv/bin/python -m eval long_reads "${@:2}"; }
(
  run 0 --corpus lookalike --adapter "$ADAPTER4" --label recipe4 --readings skim:8K\>1K full:1K snapkv:8K
) > "$LOGS/queue0.log" 2>&1 &
(
  # the gates beside the base records of the noise runs (eval/tune/results/gate_noise/on_forward: invariant mode on, as these)
  mkdir -p eval/tune/results/tune_gates_recipe4 && cp -r eval/tune/results/gate_noise/on_forward/base_* eval/tune/results/tune_gates_recipe4/
  OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python -m eval tune_gates --variant tuned --adapter "$ADAPTER4" --out eval/tune/results/tune_gates_recipe4
  run 1 --corpus lookalike --readings snapkv:8K
  run 1 --corpus sample --adapter snapkv_rag/adapter_training/shipped/smollm2-135m-instruct --label recipe3 --readings snapkv:whole
) > "$LOGS/queue1.log" 2>&1 &
wait
.venv/bin/python -m eval long_reads --corpus lookalike --table-only
.venv/bin/python -m eval long_reads --corpus sample --table-only

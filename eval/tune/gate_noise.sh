#!/usr/bin/env bash
# The tune gates' noise (issue 65): the gates run twice with the invariant mode on and twice with
# it off, the second run of each computing the same prompts in the reverse order (another
# prefix-cache history). With the mode on both models run (base and the shipped adapter); with it
# off the base model only unless OFF_VARIANTS="base tuned" (the mode-off runs show the noise the
# mode removes; one model shows it, at half the time). Two runs at a time, one thread each, about
# 17 minutes a pair on 2 idle cores. Resumable: a run whose records are all there is skipped. Then:
#   .venv/bin/python -m eval gate_noise
set -euo pipefail
cd "$(dirname "$0")/../.."
ADAPTER=${ADAPTER:-snapkv_rag/adapter_training/shipped/smollm2-135m-instruct}
OUT=${OUT:-eval/tune/results/gate_noise}
OFF_VARIANTS=${OFF_VARIANTS:-base}
jobs=()
for mode in on off; do
  variants="base tuned"; [[ $mode == off ]] && variants=$OFF_VARIANTS
  for order in forward reversed; do
    for variant in $variants; do
      dir="$OUT/${mode}_${order}"
      [[ -f "$dir/${variant}_answers/records.jsonl" && -f "$dir/${variant}_tools/records.jsonl" ]] && continue
      jobs+=("$mode $order $variant")
    done
  done
done
run() {  # mode order variant core
  local dir="$OUT/$1_$2" adapter=()
  [[ $3 == tuned ]] && adapter=(--adapter "$ADAPTER")
  mkdir -p "$dir"
  echo "run $dir $3"
  OMP_NUM_THREADS=1 taskset -c "$4" .venv/bin/python -m eval tune_gates --variant "$3" "${adapter[@]}" --invariant "$1" --order "$2" --out "$dir" > "$dir.$3.log" 2>&1
}
for ((i = 0; i < ${#jobs[@]}; i += 2)); do
  run ${jobs[i]} 0 &
  if ((i + 1 < ${#jobs[@]})); then run ${jobs[i + 1]} 1 & fi
  wait
done
.venv/bin/python -m eval gate_noise

#!/usr/bin/env bash
# Train the embedded model's LoRA adapter, ship it into the package and measure its gates
# (issue 47; docs/tune.md). On 2 CPU cores: about 80 minutes of training, then about 30 of
# gates. Run it again after a stop: training resumes from its checkpoint (it exits 75 when
# stopped early), and a finished run is not trained again.
set -euo pipefail
cd "$(dirname "$0")/.."
# a run directory per data recipe: a checkpoint of another recipe is refused, not resumed
RUN=${RUN:-tune-runs/smollm2-recipe3}
SHIPPED=snapkv_rag/adapter_training/shipped/smollm2-135m-instruct
.venv/bin/snapkv-rag tune train --out "$RUN"
.venv/bin/snapkv-rag tune ship "$RUN/adapter"
# the bare and the tuned model at once, one core and one thread each
OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m eval tune_gates --variant base > "$RUN/gates_base.log" 2>&1 &
OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python -m eval tune_gates --variant tuned --adapter "$SHIPPED" > "$RUN/gates_tuned.log" 2>&1 &
wait
.venv/bin/python -m eval tune_gates --table-only --manifest "$SHIPPED"

#!/usr/bin/env bash
# Reproduce eval/results/ on the embedded model (speed, needle, sensitivity, fidelity: about an hour on 2 CPU cores;
# citation, attribution and window took 38, 16 and 24 minutes on the shared machine under load 10+).
# Usage: bash eval/run_all.sh [task ...]   (default: speed batch needle sensitivity citation attribution window fidelity less less-h2o less-gap)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=eval/results
CLI=".venv/bin/snapkv-rag eval"
tasks=("$@")
[ ${#tasks[@]} -gt 0 ] || tasks=(speed batch needle sensitivity citation attribution window fidelity less less-h2o less-gap)
for task in "${tasks[@]}"; do
  case "$task" in
    speed) $CLI speed --lengths 1000,2000,4000,8000 --budgets 1024 --methods snapkv streamingllm h2o random --repeats 2 --out $OUT/speed ;;
    batch) $CLI speed --lengths 1000 --budgets 1024 --methods snapkv --batch-sizes 4 --out $OUT/batch ;;
    needle) $CLI needle --lengths 1000,2000 --budgets 256,512,1024 --methods snapkv 'snapkv:window=16,kernel=5' streamingllm h2o random --out $OUT/needle ;;
    sensitivity) $CLI needle --lengths 1500,2000 --budgets 256,512 --methods snapkv 'snapkv:window=16' 'snapkv:kernel=13' 'snapkv:kernel=5,pooling=avg' 'snapkv:window=16,kernel=5' --out $OUT/sensitivity ;;
    # RAG pipeline (ingest examples/sample_corpus, retrieve, stuff, DocumentQA); also the RAG half of fixed vs question-aligned windows
    citation) $CLI citation --context-tokens 1000 --questions 12 --max-new-tokens 32 --methods snapkv 'snapkv:window=question' --budgets 256,512 --threads 1 --out $OUT/citation ;;
    # the uncompressed answers to all 40 sample questions, for choosing the attribution method
    attribution) $CLI citation --context-tokens 1000 --max-new-tokens 32 --methods full --no-noise-floor --threads 1 --out $OUT/attribution ;;
    window) $CLI needle --lengths 1000,2000 --budgets 256,512 --methods snapkv 'snapkv:window=question' --threads 1 --out $OUT/window_needle ;;
    # LESS vs SnapKV vs baseline+ on held-out text (shipped kernels; train them with `snapkv-rag less train`)
    less) $CLI fidelity --text heldout --lengths 2048,4096 --prompts-per-length 3 --continuation-tokens 64 --decode-tokens 16 --budgets 64,128,256,512 --methods less:base=snapkv --threads 2 --out $OUT/less ;;
    # the same for the H2O-base kernels (budget 256, stage 1 only)
    less-h2o) $CLI fidelity --text heldout --lengths 2048,4096 --prompts-per-length 3 --continuation-tokens 64 --decode-tokens 16 --budgets 256 --methods less:base=h2o --threads 2 --out $OUT/less_h2o ;;
    # where the remaining gap sits: learned vs exact mass and value of the evicted entries, per layer (8x at 2K and at 4K)
    less-gap) for b in 256 512; do .venv/bin/snapkv-rag less gap --compression less:base=snapkv,budget=$b --lengths 2048,4096 --prompts-per-length 3 --no-progress --out $OUT/less_gap_b$b; done ;;
    fidelity) $CLI fidelity --lengths 2000,4000 --seeds 0,1 --budgets 256,512,1024 --methods snapkv streamingllm h2o random --out $OUT/fidelity ;;
    # continuous batching through the HTTP server: tokens/s and TTFT at 1-16 clients (5 min; not in the default list)
    batching) .venv/bin/python eval/batching_throughput.py --tokens 128 --out $OUT/batching ;;
    # engine replicas on Ray Serve: 1x2 threads against 2x1, affinity against round-robin routing (5 min; not in the default list)
    ray-replicas) .venv/bin/python eval/ray_replicas.py --out $OUT/ray_replicas ;;
    *) echo "unknown task $task" >&2; exit 2 ;;
  esac
done

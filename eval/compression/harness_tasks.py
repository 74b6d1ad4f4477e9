"""The `snapkv-rag eval` and `snapkv-rag less gap` runs behind the compression and citation tables (formerly eval/run_all.sh).

Speed, needle, sensitivity, fidelity: about an hour on 2 CPU cores; citation, attribution and
window took 38, 16 and 24 minutes on the shared machine under load 10+.

    .venv/bin/python -m eval harness_tasks [task ...]   (default: speed batch needle sensitivity citation attribution window fidelity less less-h2o less-gap)
    .venv/bin/python -m eval harness_tasks --show [task ...]   (print the commands, run nothing)

Each task runs as its own process (``python -m snapkv_rag.cli ...``, what ``snapkv-rag`` runs;
``python -m eval NAME`` for the two benchmark modules), from the repository root, offline
(``HF_HUB_OFFLINE=1``), with ``--out`` under the results folder of the area whose page reports
it: eval/compression/results/ (speed, batch, needle, sensitivity, window_needle, fidelity, less,
less_h2o, less_gap_b*), eval/rag/results/ (citation, attribution), eval/serving/results/
(batching, ray_replicas).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path

from eval.common.processes import child_env, module_command

ROOT = Path(__file__).resolve().parents[2]

C, R, S = "eval/compression/results", "eval/rag/results", "eval/serving/results"

# task: (what it measures, its commands: `snapkv-rag ...` runs as `python -m snapkv_rag.cli ...`)
TASKS: dict[str, tuple[str, list[str]]] = {
    "speed": ("prefill, decode and memory against prompt length", [
        f"snapkv-rag eval speed --lengths 1000,2000,4000,8000 --budgets 1024 --methods snapkv streamingllm h2o random --repeats 2 --out {C}/speed",
    ]),
    "batch": ("the same at batch 4", [
        f"snapkv-rag eval speed --lengths 1000 --budgets 1024 --methods snapkv --batch-sizes 4 --out {C}/batch",
    ]),
    "needle": ("pass-key retrieval under each method and budget", [
        f"snapkv-rag eval needle --lengths 1000,2000 --budgets 256,512,1024 --methods snapkv snapkv:window=16,kernel=5 streamingllm h2o random --out {C}/needle",
    ]),
    "sensitivity": ("SnapKV's window, kernel and pooling on the needle", [
        f"snapkv-rag eval needle --lengths 1500,2000 --budgets 256,512 --methods snapkv snapkv:window=16 snapkv:kernel=13 snapkv:kernel=5,pooling=avg snapkv:window=16,kernel=5 --out {C}/sensitivity",
    ]),
    "citation": ("RAG pipeline (ingest examples/sample_corpus, retrieve, stuff, DocumentQA); also the RAG half of fixed vs question-aligned windows", [
        f"snapkv-rag eval citation --context-tokens 1000 --questions 12 --max-new-tokens 32 --methods snapkv snapkv:window=question --budgets 256,512 --threads 1 --out {R}/citation",
    ]),
    "attribution": ("the uncompressed answers to all 40 sample questions, for choosing the attribution method", [
        f"snapkv-rag eval citation --context-tokens 1000 --max-new-tokens 32 --methods full --no-noise-floor --threads 1 --out {R}/attribution",
    ]),
    "window": ("the needle half of fixed vs question-aligned windows", [
        f"snapkv-rag eval needle --lengths 1000,2000 --budgets 256,512 --methods snapkv snapkv:window=question --threads 1 --out {C}/window_needle",
    ]),
    "less": ("LESS vs SnapKV vs baseline+ on held-out text (shipped kernels; train them with `snapkv-rag less train`)", [
        f"snapkv-rag eval fidelity --text heldout --lengths 2048,4096 --prompts-per-length 3 --continuation-tokens 64 --decode-tokens 16 --budgets 64,128,256,512 --methods less:base=snapkv --threads 2 --out {C}/less",
    ]),
    "less-h2o": ("the same for the H2O-base kernels (budget 256, stage 1 only)", [
        f"snapkv-rag eval fidelity --text heldout --lengths 2048,4096 --prompts-per-length 3 --continuation-tokens 64 --decode-tokens 16 --budgets 256 --methods less:base=h2o --threads 2 --out {C}/less_h2o",
    ]),
    "less-gap": ("where the remaining gap sits: learned vs exact mass and value of the evicted entries, per layer (8x at 2K and at 4K)", [
        f"snapkv-rag less gap --compression less:base=snapkv,budget={b} --lengths 2048,4096 --prompts-per-length 3 --no-progress --out {C}/less_gap_b{b}"
        for b in (256, 512)
    ]),
    "fidelity": ("next-token KL and greedy agreement against the full cache on document prompts", [
        f"snapkv-rag eval fidelity --lengths 2000,4000 --seeds 0,1 --budgets 256,512,1024 --methods snapkv streamingllm h2o random --out {C}/fidelity",
    ]),
    "batching": ("continuous batching through the HTTP server: tokens/s and TTFT at 1-16 clients (5 min; not in the default list)", [
        f"python -m eval batching_throughput --tokens 128 --out {S}/batching",
    ]),
    "ray-replicas": ("engine replicas on Ray Serve: 1x2 threads against 2x1, affinity against round-robin routing (5 min; not in the default list)", [
        f"python -m eval ray_replicas --out {S}/ray_replicas",
    ]),
}  # fmt: skip
DEFAULT_TASKS = ["speed", "batch", "needle", "sensitivity", "citation", "attribution", "window", "fidelity", "less", "less-h2o", "less-gap"]


def argv_of(command: str) -> list[str]:
    """A task's command as this interpreter's argument list (``snapkv-rag`` is ``snapkv_rag.cli``)."""
    words = shlex.split(command)
    if words[0] == "snapkv-rag":
        return module_command("snapkv_rag.cli", *words[1:])
    assert words[:2] == ["python", "-m"], command
    return module_command(words[2], *words[3:])


def commands(tasks: list[str]) -> list[str]:
    """The commands ``tasks`` run, in order."""
    return [command for task in tasks for command in TASKS[task][1]]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m eval harness_tasks",
        description=__doc__.split("\n\n")[0],
        epilog="tasks: " + "; ".join(f"{name}: {what}" for name, (what, _) in TASKS.items()),
    )
    ap.add_argument("tasks", nargs="*", metavar="task", help=f"one of {', '.join(TASKS)} (default: {' '.join(DEFAULT_TASKS)})")
    ap.add_argument("--show", action="store_true", help="print the commands and run nothing")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if unknown := [t for t in args.tasks if t not in TASKS]:
        ap.error(f"unknown task {' '.join(unknown)}; choose from {', '.join(TASKS)}")
    tasks = args.tasks or DEFAULT_TASKS
    env = {**child_env(), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for command in commands(tasks):
        print(f"$ {command}", flush=True)
        if not args.show:
            subprocess.run(argv_of(command), cwd=ROOT, env=env, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

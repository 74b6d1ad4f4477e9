"""Does ``torch.compile`` of the decode step pay on the CPU? (issue 25)

Not a test. The embedded model in bf16 with transformers' StaticCache (1,024 entries, so every
decode step has the same shapes) and plain SDPA attention, outside the engine: a 512-token
prompt, then 40 greedy decode steps, median ms per step. One mode per run:

    .venv/bin/python eval/compile_probe.py eager-packed      # the engine's default weights
    .venv/bin/python eval/compile_probe.py eager-plain       # nn.Linear as loaded
    .venv/bin/python eval/compile_probe.py compiled          # torch.compile(model.forward), plain weights
    .venv/bin/python eval/compile_probe.py compiled-freeze   # the same with inductor's freezing (weights prepacked)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

MODES = ("eager-packed", "eager-plain", "compiled", "compiled-freeze")


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "eager-packed"
    if mode not in MODES:
        sys.exit(f"mode must be one of {', '.join(MODES)}")
    from transformers import StaticCache

    from snapkv_rag.model.loading import load_model_and_tokenizer

    torch.set_num_threads(2)
    model, _, _ = load_model_and_tokenizer("default", dtype="bfloat16", attn_implementation="sdpa", pack_weights=None if mode == "eager-packed" else False)
    forward = model.forward
    if mode.startswith("compiled"):
        import torch._inductor.config as inductor_config

        inductor_config.freezing = mode == "compiled-freeze"
        forward = torch.compile(model.forward, dynamic=False)
    cache = StaticCache(config=model.config, max_cache_len=1024)
    ids = torch.randint(100, 40000, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True, cache_position=torch.arange(512), logits_to_keep=1)
        token, position = out.logits[:, -1].argmax(-1, keepdim=True), 512

        def step():
            nonlocal token, position
            out = forward(input_ids=token, cache=cache, use_cache=True, cache_position=torch.tensor([position]), logits_to_keep=1)
            token, position = out.logits[:, -1].argmax(-1, keepdim=True), position + 1

        start = time.perf_counter()
        for _ in range(3):
            step()
        warmup = time.perf_counter() - start
        times = []
        for _ in range(40):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    times.sort()
    print(f"{mode}: first 3 steps (compilation) {warmup:.1f} s, then {times[20] * 1000:.1f} ms per step (median of 40)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

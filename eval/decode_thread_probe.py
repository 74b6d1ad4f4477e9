"""Does decoding on another thread than the one that loaded the model cost time? (issue 25)

Not a test. Loads the embedded model on the main thread, prefills a 500-token prompt and times
32 greedy decode steps of the bare model (no engine), on the main thread (``m``) or on a new
thread (``t``), or frees the main thread's OpenMP threads (``r``, what the engine does when a
thread hands it a request: snapkv_rag.model.openmp), in the order given:

    .venv/bin/python eval/decode_thread_probe.py mmtt
    .venv/bin/python eval/decode_thread_probe.py ttmm
    .venv/bin/python eval/decode_thread_probe.py mtrtmrt
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from snapkv_rag import Engine  # noqa: E402
from snapkv_rag.model.openmp import release_thread_pool  # noqa: E402

STEPS = 32


def decode_ms(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(STEPS):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / STEPS * 1000


def on_new_thread(model, ids: torch.Tensor) -> float:
    box: dict[str, float] = {}
    thread = threading.Thread(target=lambda: box.setdefault("ms", decode_ms(model, ids)))
    thread.start()
    thread.join()
    return box["ms"]


def main() -> int:
    order = sys.argv[1] if len(sys.argv) > 1 else "mmtt"
    engine = Engine.default(prefix_cache_bytes=0)
    ids = torch.tensor([engine.tokenizer("hello " * 500)["input_ids"][:500]])
    for step in order:
        if step == "r":
            print(f"main thread's OpenMP threads freed: {release_thread_pool()}", flush=True)
            continue
        ms = decode_ms(engine.model, ids) if step == "m" else on_new_thread(engine.model, ids)
        print(f"{'main thread' if step == 'm' else 'new thread'}: {ms:.1f} ms per token", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

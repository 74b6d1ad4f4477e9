"""Does a rolled prefill keep the needle, or lose it? (issue 46's needle misses)

For one needle case, follows every compressed layer and KV head of the embedded model through a
rolled prefill: after each chunk, which original prompt positions its kept entries came from,
and so what share of the (layer, head) pairs still hold the pass key's tokens and the 6 before
them. It observes the engine's own rolling path (``pack_positions`` is wrapped, not replaced).

    .venv/bin/python eval/rolling_needle_trace.py --cases 4096:0.1,8192:0.3,16384:0.1,32768:0.1
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import snapkv_rag.engine.rolling as rolling  # noqa: E402
from snapkv_rag import Engine  # noqa: E402
from snapkv_rag.compression import parse_compression  # noqa: E402
from snapkv_rag.engine.generation import DecodeRun  # noqa: E402
from snapkv_rag.engine.preparation import resolve_policy  # noqa: E402
from snapkv_rag.engine.prompts import render_prompt  # noqa: E402
from snapkv_rag.engine.sampling import GenerationParams  # noqa: E402
from snapkv_rag.harness.metrics import needle_exact_match  # noqa: E402
from snapkv_rag.harness.needle import build_needle_case  # noqa: E402


def trace(engine: Engine, length: int, depth: float, spec: str) -> dict:
    case = build_needle_case(engine.tokenizer, length, depth, seed=int(depth * 100) + length)
    row = render_prompt(engine.tokenizer, case.prompt)
    key = engine.tokenizer(case.answer, add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(row)) if row[i : i + len(key)] == key)
    span = torch.zeros(len(row), dtype=torch.bool)
    span[max(0, start - 6) : start + len(key)] = True  # "the pass key is" and the key
    policy = resolve_policy(engine, parse_compression(spec), [case.prompt], None, [None])[0]
    plan = rolling.rolling_plan(len(row), policy)
    assert plan is not None, "this case does not roll"
    origins: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, held] prompt positions of the kept entries
    shares: list[float] = []
    original_pack = rolling.pack_positions

    def observed(cache, kept, shift):
        a, b = plan.chunks[len(shares)]
        for layer, indices in kept.items():
            held = origins.get(layer, torch.empty(1, indices.shape[1], 0, dtype=torch.long))
            space = torch.cat([held, torch.arange(a, b).expand(1, indices.shape[1], -1)], dim=-1)
            origins[layer] = space.gather(-1, indices.cpu())
        shares.append(share(origins, span))
        return original_pack(cache, kept, shift)

    rolling.pack_positions = observed
    try:
        run = DecodeRun(engine.model, [row], GenerationParams(max_new_tokens=12), policy, engine._pad_id, eos_ids=engine._eos_ids)
        run.prefill()
    finally:
        rolling.pack_positions = original_pack
    a, b = plan.chunks[-1]
    final = {}
    for layer, indices in run.session.kept_indices.items():
        held = origins.get(layer, torch.empty(1, indices.shape[1], 0, dtype=torch.long))
        final[layer] = torch.cat([held, torch.arange(a, b).expand(1, indices.shape[1], -1)], dim=-1).gather(-1, indices.cpu())
    answer = engine.generate(case.prompt, compression=spec, max_new_tokens=12).text
    return {
        "length": len(row),
        "depth": depth,
        "hit": needle_exact_match(answer, case.answer),
        "answer": answer,
        "needle_chunk": next(i for i, (a, b) in enumerate(plan.chunks) if a <= start < b),
        "chunks": len(plan.chunks),
        "share_after_chunks": shares,
        "share_final": share(final, span),
        "pairs_without_needle": sum(int(not span[o].any()) for o in (final[layer][0, h] for layer in final for h in range(final[layer].shape[1]))),
        "pairs": sum(final[layer].shape[1] for layer in final),
    }


def share(origins: dict[int, torch.Tensor], span: torch.Tensor) -> float:
    """Mean over (layer, head) of the share of the needle span's positions they keep."""
    values = [float(span[o].sum()) / float(span.sum()) for o in (origins[layer][0, h] for layer in origins for h in range(origins[layer].shape[1]))]
    return sum(values) / len(values) if values else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="4096:0.1,8192:0.3,16384:0.1,32768:0.1", help="length:depth pairs")
    p.add_argument("--spec", default="snapkv:budget=1024,window=question,rolling=1024")
    args = p.parse_args()
    engine = Engine.default()
    print("| prompt tokens | depth | found | needle in chunk | chunks | needle span kept (mean over layer-heads), final | layer-heads without it |")
    print("|---|---|---|---|---|---|---|")
    for item in args.cases.split(","):
        length, depth = item.split(":")
        r = trace(engine, int(length), float(depth), args.spec)
        print(
            f"| {r['length']:,} | {r['depth']} | {'yes' if r['hit'] else 'no'} | {r['needle_chunk'] + 1} | {r['chunks']} | {r['share_final']:.2f} | "
            f"{r['pairs_without_needle']} of {r['pairs']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Per-token cost of grammar-constrained decoding on the embedded model, and the grammar-engine comparison.

Usage: .venv/bin/python -m eval tool_overhead [--repeats 3] [--out eval/agents/results/tools]

1. Engine overhead: the embedded SmolLM2 generates (greedy) a forced tool call, an "auto"
   answer (free text under the tool grammar), a JSON-schema answer, and the same prompts
   unconstrained. For each run it records the median decode step (the forward,
   ``stats.decode_ms_per_token``) and the median grammar work per step (mask + advance,
   ``stats.constraint_ms_per_step``), both measured in the same run, and their ratio.
2. Grammar engines: llguidance (used) and xgrammar (if importable; it is not a dependency)
   replay the same token sequences on SmolLM2's tokenizer: tokenizer setup, grammar compile,
   and mask computation + token advance per token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAGIC = {
    "type": "function",
    "function": {
        "name": "magic_function",
        "description": "Applies a magic function to an input.",
        "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a place.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["location", "unit", "days"],
        },
    },
}
CITY = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
            "required": ["city", "country", "facts"],
        },
    },
}

SCENARIOS = [
    ("required call (nested schema)", "What will the weather be in Paris for the next 3 days, in celsius?", dict(tools=[WEATHER], tool_choice="required")),
    ("auto, answered in text", "What is the value of magic_function(3)?", dict(tools=[MAGIC], tool_choice="auto")),
    ("json_schema output", "Describe Paris in JSON with three facts.", dict(response_format=CITY)),
    ("unconstrained (baseline)", "Describe Paris in JSON with three facts.", {}),
]


def engine_overhead(repeats: int, max_new_tokens: int) -> list[dict]:
    import torch

    from snapkv_rag import Engine

    engine = Engine.default()
    engine.generate("What is magic_function(3)?", tools=[MAGIC], tool_choice="required", max_new_tokens=40)  # warm-up; builds the grammar tokenizer
    records = []
    for repeat in range(repeats):
        for name, prompt, options in SCENARIOS:  # interleaved, so drift hits every scenario alike
            result = engine.generate([{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens, **options)
            constraint_ms = result.stats.constraint_ms_per_step
            records.append(
                {
                    "scenario": name,
                    "repeat": repeat,
                    "steps": result.stats.decode_steps,
                    "decode_ms_per_token": result.stats.decode_ms_per_token,
                    "constraint_ms_per_step": constraint_ms,
                    "overhead_pct": 100 * constraint_ms / result.stats.decode_ms_per_token if constraint_ms is not None else None,
                    "finish_reason": result.finish_reason,
                    "tool_calls": [c.to_dict() for c in result.tool_calls],
                    "text": result.text[:200],
                    "threads": torch.get_num_threads(),
                    "loadavg_1min": os.getloadavg()[0],
                }
            )
            print(json.dumps(records[-1], ensure_ascii=False), flush=True)
    return records


def _replay_llguidance(tokenizer, grammar: str, ids: list[int]) -> tuple[float, list[float]]:
    import torch

    from snapkv_rag.tools.constraints import BatchConstraint

    start = time.perf_counter()
    constraint = BatchConstraint([_LLG.matcher(grammar)], _LLG)
    compile_s = time.perf_counter() - start
    logits = torch.zeros(1, _LLG.vocab_size)
    for token in ids:
        constraint.mask(logits)
        constraint.advance([token])
    return compile_s, constraint.step_seconds


def _replay_xgrammar(compiler, kind: str, payload, ids: list[int], vocab: int) -> tuple[float, list[float]]:
    import torch
    import xgrammar as xgr

    start = time.perf_counter()
    if kind == "json":
        compiled = compiler.compile_json_schema(json.dumps(payload), any_whitespace=False, separators=(", ", ": "))
    else:
        tags = [xgr.StructuralTagItem(begin="<tool_call>\n" + payload[0], schema=json.dumps(payload[1]), end="}\n</tool_call>")]
        compiled = compiler.compile_structural_tag(tags, ["<tool_call>"])
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    logits = torch.zeros(1, vocab)
    steps = []
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        if not matcher.accept_token(token):
            raise RuntimeError("xgrammar rejected the replayed token")
        steps.append(time.perf_counter() - t)
    return compile_s, steps


_LLG = None


def grammar_engines() -> list[dict]:
    global _LLG
    from transformers import AutoTokenizer

    from snapkv_rag.model.loading import converted_gguf_dir, embedded_gguf_path
    from snapkv_rag.tools import build_output_spec, call_prefix, format_call
    from snapkv_rag.tools.constraints import GrammarTokenizer, grammar_for

    tokenizer = AutoTokenizer.from_pretrained(converted_gguf_dir(embedded_gguf_path()), local_files_only=True)
    vocab = len(tokenizer)
    args = {"location": {"city": "Paris", "country": "France"}, "unit": "celsius", "days": 3}
    schema = WEATHER["function"]["parameters"]
    call_text = format_call("get_weather", args)
    answer = "The value of magic_function(3) is 3. The function is a magic function that is used to perform a magic operation."
    cases = [
        ("forced call", call_text, build_output_spec([WEATHER], "required"), ("tag", (call_prefix("get_weather"), schema))),
        ("auto: free text", answer, build_output_spec([WEATHER], "auto"), ("tag", (call_prefix("get_weather"), schema))),
        (
            "json_schema",
            json.dumps({"city": "Paris", "country": "France", "facts": ["a", "b"]}),
            build_output_spec(response_format=CITY),
            ("json", CITY["json_schema"]["schema"]),
        ),
    ]
    rows = []
    start = time.perf_counter()
    _LLG = GrammarTokenizer(tokenizer, vocab, [tokenizer.eos_token_id])
    llg_setup = time.perf_counter() - start
    try:
        import xgrammar as xgr

        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        xgr_setup = time.perf_counter() - start
    except ImportError:
        xgr = None
    for name, text, spec, xgr_case in cases:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        engines = [("llguidance", llg_setup, lambda spec=spec, ids=ids: _replay_llguidance(tokenizer, grammar_for(spec), ids))]
        if xgr is not None:
            engines.append(("xgrammar", xgr_setup, lambda case=xgr_case, ids=ids: _replay_xgrammar(compiler, case[0], case[1], ids, vocab)))
        for engine, setup_s, replay in engines:
            compile_s, steps = replay()
            rows.append(
                {
                    "case": name,
                    "engine": engine,
                    "tokens": len(ids),
                    "tokenizer_setup_s": setup_s,
                    "compile_ms": compile_s * 1000,
                    "mask_ms_median": statistics.median(steps) * 1000,
                    "mask_ms_max": max(steps) * 1000,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(overhead: list[dict], engines: list[dict]) -> str:
    load = [r["loadavg_1min"] for r in overhead]
    lines = [
        f"1-minute load average during the runs: {min(load):.1f} to {max(load):.1f} (2 cores)",
        "",
        "| scenario | runs | steps | decode ms/token | grammar ms/step | overhead |",
        "|---|---|---|---|---|---|",
    ]
    for name, _, _ in SCENARIOS:
        rs = [r for r in overhead if r["scenario"] == name]
        decode = statistics.median(r["decode_ms_per_token"] for r in rs)
        cons = [r["constraint_ms_per_step"] for r in rs if r["constraint_ms_per_step"] is not None]
        pct = [r["overhead_pct"] for r in rs if r["overhead_pct"] is not None]
        lines.append(
            f"| {name} | {len(rs)} | {statistics.median(r['steps'] for r in rs):.0f} | {decode:.1f} | "
            + (f"{statistics.median(cons):.3f} | {statistics.median(pct):.2f}% (max {max(pct):.2f}%) |" if cons else "- | - |")
        )
    lines += ["", "| case | engine | tokens | tokenizer setup s | compile ms | mask+advance ms/token (median) | max |", "|---|---|---|---|---|---|---|"]
    for r in engines:
        lines.append(
            f"| {r['case']} | {r['engine']} | {r['tokens']} | {r['tokenizer_setup_s']:.2f} | {r['compile_ms']:.2f} | {r['mask_ms_median']:.3f} | {r['mask_ms_max']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval tool_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "tools"))
    return parser


def main(argv: list[str] | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engines = grammar_engines()
    overhead = engine_overhead(args.repeats, args.max_new_tokens)
    with (out / "tool_overhead.jsonl").open("w") as fh:
        for r in overhead + engines:
            fh.write(json.dumps({**r, "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}, ensure_ascii=False) + "\n")
    summary = markdown(overhead, engines)
    (out / "summary.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    raise SystemExit(main())

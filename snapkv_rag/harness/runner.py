"""Run the four evaluation tasks: compressed and uncompressed runs in one process, interleaved.

Every record carries the settings of ``docs/design/evaluation-method.md``: model, method and its
settings (window, budget, kernel, pooling, question-aware), prompt length, batch size,
dtype, device, threads and toolkit version.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .._version import __version__
from ..compression import CompressionPolicy, parse_compression
from ..errors import InvalidCompressionError
from ..model.packed_linear import packed_weight_bytes
from .citation import build_questions
from .metrics import greedy_agreement, needle_exact_match, next_token_kl
from .needle import build_needle_case

Record = dict[str, Any]


@dataclass(frozen=True)
class Method:
    """A labelled policy; ``policy is None`` is the uncompressed reference."""

    label: str
    policy: CompressionPolicy | None
    budget: int | None

    def settings(self) -> dict[str, Any]:
        return self.policy.settings() if self.policy is not None else {"method": "full", "question_aware": False}


FULL = Method("full", None, None)


def method_grid(specs: Sequence[str], budgets: Sequence[int]) -> list[Method]:
    """Each spec (``snapkv``, ``snapkv:window=16,kernel=5``, ``h2o`` ...) at each budget.

    All combinations are validated before anything runs.
    """
    methods = []
    for spec in specs:
        base = parse_compression(spec)
        if base.max_capacity_prompt is None:  # "full" is always run as the reference
            continue
        for budget in budgets:
            try:
                policy = base.with_budget(int(budget))
            except InvalidCompressionError as exc:
                raise InvalidCompressionError(f"{spec} at budget {budget}: {exc}") from None
            methods.append(Method(spec, policy, int(budget)))
    return methods


def common_fields(engine, task: str, method: Method, prompt_tokens: int, batch_size: int = 1) -> Record:
    info = engine.info()
    return {
        "task": task,
        "model": info.name,
        "method": method.label,
        "budget": method.budget,
        "settings": method.settings(),
        "prompt_tokens": prompt_tokens,
        "batch_size": batch_size,
        "dtype": info.dtype,
        "device": info.device,
        "threads": torch.get_num_threads(),
        "invariant": bool(getattr(engine, "invariant", False)),  # batch-invariant, chunk-aligned prefills (engine/invariant.py)
        "version": __version__,
    }


def resolved_window(result) -> list[int] | None:
    """The observation window each row used when the policy resolves it per prompt (``window=question``)."""
    return (result.stats.compression or {}).get("resolved_window_sizes")


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)


# ---------------------------------------------------------------------------------- needle
def run_needle(
    engine,
    methods: Sequence[Method],
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    *,
    seeds: Sequence[int] = (0,),
    max_new_tokens: int = 16,
    progress: bool = True,
) -> list[Record]:
    runs = [FULL, *methods]
    records: list[Record] = []
    bar = _progress(len(lengths) * len(depths) * len(seeds) * len(runs), "needle", progress)
    for length in lengths:
        for depth in depths:
            for seed in seeds:
                case = build_needle_case(engine.tokenizer, length, depth, seed=seed + int(depth * 1000))
                full_found = None
                for method in runs:
                    result = engine.generate(case.prompt, max_new_tokens=max_new_tokens, compression=method.policy)
                    found = needle_exact_match(result.text, case.answer)
                    full_found = found if method is FULL else full_found
                    records.append(
                        {
                            **common_fields(engine, "needle", method, result.usage.prompt_tokens),
                            "target_tokens": length,
                            "depth": depth,
                            "seed": seed,
                            "answer": case.answer,
                            "output": result.text,
                            "found": found,
                            "full_found": full_found,
                            "prefill_seconds": result.stats.prefill_seconds,
                            "prompt_kv_bytes_kept": result.stats.prompt_kv_bytes_kept,
                            "resolved_window": resolved_window(result),
                        }
                    )
                    bar.update()
    bar.close()
    return records


def _with_threads(threads: int, fn, *args, **kwargs):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


# -------------------------------------------------------------------------------- fidelity
def fidelity_prompt(length: int, seed: int):
    """A long-context prompt of about ``length`` tokens: a document collection and a question."""
    tokens_per_doc = 28
    n_docs = max(3, round((length - 120) / tokens_per_doc))
    return build_questions(n_docs, 1, seed=seed)[0].messages


def run_fidelity(
    engine,
    methods: Sequence[Method],
    lengths: Sequence[int],
    *,
    continuation_tokens: int = 32,
    seeds: Sequence[int] = (0,),
    progress: bool = True,
) -> list[Record]:
    """Greedy agreement with the uncompressed continuation and teacher-forced KL / top-1 over it."""
    records: list[Record] = []
    bar = _progress(len(lengths) * len(seeds) * (len(methods) + 1), "fidelity", progress)
    for length in lengths:
        for seed in seeds:
            prompt = fidelity_prompt(length, seed)
            reference = engine.generate(prompt, max_new_tokens=continuation_tokens, ignore_eos=True)
            full_logits = engine.score(prompt, reference.token_ids)
            bar.update()
            for method in methods:
                result = engine.generate(prompt, max_new_tokens=continuation_tokens, ignore_eos=True, compression=method.policy)
                logits = engine.score(prompt, reference.token_ids, compression=method.policy)
                kl, top1 = next_token_kl(full_logits, logits)
                prefix, overall = greedy_agreement(reference.token_ids, result.token_ids)
                records.append(
                    {
                        **common_fields(engine, "fidelity", method, result.usage.prompt_tokens),
                        "target_tokens": length,
                        "seed": seed,
                        "continuation_tokens": len(reference.token_ids),
                        "agreement_prefix": prefix,
                        "agreement_overall": overall,
                        "kl_mean": float(kl.mean()),
                        "kl_max": float(kl.max()),
                        "top1_agreement": float(top1.float().mean()),
                        "prompt_kv_bytes_kept": result.stats.prompt_kv_bytes_kept,
                        "resolved_window": resolved_window(result),
                    }
                )
                bar.update()
    bar.close()
    return records


# ----------------------------------------------------------------------------------- speed
def measure_bandwidth(device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (each byte read once and written once)."""
    device = torch.device(device)
    src = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes(model) -> int:
    """Parameters plus the weights held outside them (int8 buffers, oneDNN-packed layers)."""
    held = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.int8)
    return sum(p.numel() * p.element_size() for p in model.parameters()) + held + packed_weight_bytes(model)


def run_speed(
    engine,
    methods: Sequence[Method],
    lengths: Sequence[int],
    *,
    new_tokens: int = 32,
    repeats: int = 1,
    batch_sizes: Sequence[int] = (),
    progress: bool = True,
) -> list[Record]:
    """Prefill s, decode ms/token, KV bytes and peak memory; methods interleaved per length.

    Each decode figure sits beside its floor ``(weight_bytes + kept_kv_bytes) / bandwidth``.
    With ``batch_sizes``, also ``B`` prompts of about the same length run as one
    ``generate_batch`` call and as ``B`` single calls, interleaved: records with
    ``kind == "batch"`` hold both wall times and the generated tokens per second.
    """
    bandwidth = measure_bandwidth(engine.device)
    weights = weight_bytes(engine.model)
    engine.generate("Warm up the kernels.", max_new_tokens=4)  # first calls pay one-time costs
    runs = [FULL, *methods]
    records: list[Record] = []
    bar = _progress(repeats * len(lengths) * len(runs), "speed", progress)
    for repeat in range(repeats):
        for length in lengths:
            prompt = build_needle_case(engine.tokenizer, length, 0.5, seed=repeat).prompt
            for method in runs:
                # prefix_cache=False: every method pays its own full prefill (methods share prompts)
                result = engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True, compression=method.policy, prefix_cache=False)
                s = result.stats
                floor_ms = (weights + s.prompt_kv_bytes_kept) / bandwidth * 1000
                records.append(
                    {
                        **common_fields(engine, "speed", method, result.usage.prompt_tokens),
                        "target_tokens": length,
                        "repeat": repeat,
                        "new_tokens": result.usage.completion_tokens,
                        "prefill_seconds": s.prefill_seconds,
                        "prefill_tokens_per_second": result.usage.prompt_tokens / s.prefill_seconds,
                        "decode_ms_per_token": s.decode_ms_per_token,
                        "decode_tokens_per_second": 1000 / s.decode_ms_per_token if s.decode_ms_per_token else None,
                        "prompt_kv_bytes_full": s.prompt_kv_bytes_full,
                        "prompt_kv_bytes_kept": s.prompt_kv_bytes_kept,
                        "peak_memory_bytes": s.peak_memory_bytes,
                        "peak_memory_kind": s.peak_memory_kind,
                        "peak_memory_added_bytes": s.peak_memory_added_bytes,
                        "weight_bytes": weights,
                        "bandwidth_bytes_per_second": bandwidth,
                        "decode_floor_ms": floor_ms,
                    }
                )
                bar.update()
    for size in batch_sizes:
        for length in lengths:
            prompts = [build_needle_case(engine.tokenizer, length, 0.5, seed=100 + i).prompt for i in range(size)]
            for method in runs:
                records.append(_batch_vs_single(engine, method, prompts, new_tokens))
    bar.close()
    return records


def _batch_vs_single(engine, method: Method, prompts: list[str], new_tokens: int) -> Record:
    """One ``generate_batch`` over ``prompts`` against one ``generate`` per prompt."""
    kwargs = dict(max_new_tokens=new_tokens, ignore_eos=True, compression=method.policy, prefix_cache=False)
    start = time.perf_counter()
    batch = engine.generate_batch(prompts, **kwargs)
    batch_s = time.perf_counter() - start
    start = time.perf_counter()
    singles = [engine.generate(p, **kwargs) for p in prompts]
    single_s = time.perf_counter() - start
    return {
        **common_fields(engine, "speed", method, round(statistics.mean(r.usage.prompt_tokens for r in batch)), len(prompts)),
        "kind": "batch",
        "target_tokens": None,
        "new_tokens": new_tokens,
        "largest_bucket": max(r.stats.batch_size for r in batch),
        "batch_seconds": batch_s,
        "single_seconds": single_s,
        "batch_tokens_per_second": sum(r.usage.completion_tokens for r in batch) / batch_s,
        "single_tokens_per_second": sum(r.usage.completion_tokens for r in singles) / single_s,
        "batch_decode_ms_per_step": median(r.stats.decode_ms_per_token for r in batch),
        "single_decode_ms_per_step": median(r.stats.decode_ms_per_token for r in singles),
        "same_tokens": [r.token_ids for r in batch] == [r.token_ids for r in singles],
    }


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")

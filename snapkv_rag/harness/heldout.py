"""Fidelity on held-out plain text (``snapkv-rag eval fidelity --text heldout``), with LESS rows.

Prompts are consecutive windows of the LESS held-out split (:mod:`snapkv_rag.less_training.corpus`,
disjoint from the training split); the continuation is the text's own next tokens, teacher
forced through each method's cache. Per prompt and method: mean KL(full || method) over the
continuation and the perplexity of the continuation. For a LESS method at budget ``B`` the
runner also runs its base policy at ``B`` and "baseline+": the base policy at ``B + extra``,
``extra`` = the LESS state's memory in cached tokens (rounded up), so LESS and baseline+
hold the same memory. Decode ms/token of base and LESS come from a short greedy decode of
the same prompt, interleaved (the first prompt of each length only). Everything runs through
the engine's :meth:`~snapkv_rag.engine.engine.Engine.token_run` (on its worker),
the engine's one decode loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..compression import LESS
from ..less_training.corpus import heldout_prompts, heldout_starts
from .metrics import next_token_kl
from .runner import FULL, Method, Record, common_fields


def expand_methods(methods: Sequence[Method], engine) -> list[tuple[Method, str]]:
    """Each method with its role; a LESS method brings its base policy and baseline+ along."""
    out: list[tuple[Method, str]] = []
    seen = set()

    def add(method: Method, role: str) -> None:
        key = (method.label, method.budget, role)
        if key not in seen:
            seen.add(key)
            out.append((method, role))

    for m in methods:
        if isinstance(m.policy, LESS):
            base = m.policy.base
            add(Method(base.name, base, m.budget), "base")
            extra = state_tokens(engine, m.policy)
            assert m.budget is not None  # LESS always has a budget
            add(Method(f"{base.name}+", base.with_budget(m.budget + extra), m.budget), "baseline+")
            add(m, "less")
        else:
            add(m, "base")
    return out


def state_tokens(engine, policy: LESS) -> int:
    """The LESS state's memory per row, in cached tokens of ``engine``'s model, rounded up."""
    info = engine.info()
    dtype_bytes = 4  # the state is kept in fp32
    layers = policy.load_kernels(engine.model).layers.values()
    state = sum(layer.state_numbers(info.head_dim) for layer in layers) * info.num_kv_heads * dtype_bytes
    return math.ceil(state / info.kv_bytes_per_token)


def _perplexity(logits: torch.Tensor, targets: list[int]) -> float:
    return math.exp(float(F.cross_entropy(logits.float(), torch.tensor(targets))))


def run_heldout_fidelity(
    engine,
    methods: Sequence[Method],
    lengths: Sequence[int],
    *,
    continuation_tokens: int = 64,
    per_length: int = 1,
    decode_tokens: int = 16,
    text: str = "pydoc",
    progress: bool = True,
) -> list[Record]:
    runs = expand_methods(methods, engine)
    prompts = heldout_prompts(engine.tokenizer, lengths, continuation_tokens, per_length, text)
    starts = heldout_starts(lengths, continuation_tokens, per_length)
    bar = tqdm(total=len(prompts) * (len(runs) + 1), desc="fidelity (held-out)", disable=not progress, leave=False)
    records: list[Record] = []
    if decode_tokens >= 2:  # the first calls pay one-time costs; keep them out of the timings
        _decode_timing(engine, prompts[0][1][:256], None, 4)
    for index, (length, prompt, continuation) in enumerate(prompts):

        def teacher_force(policy, prompt=prompt, continuation=continuation):
            run = engine.token_run(prompt, compression=policy, max_new_tokens=len(continuation))
            return run, run.teacher_force(continuation).float().cpu()

        _, full_logits = teacher_force(None)
        full_ppl = _perplexity(full_logits, continuation)
        records.append(
            _record(
                engine, FULL, "full", length, index, prompt, continuation, 0.0, full_ppl, full_ppl, None, {"heldout_start": starts[index], "heldout_text": text}
            )
        )
        bar.update()
        for method, role in runs:
            run, logits = teacher_force(method.policy)
            kl, top1 = next_token_kl(full_logits, logits)
            first_of_length = index == 0 or prompts[index - 1][0] != length
            timing = _decode_timing(engine, prompt, method.policy, decode_tokens) if role != "baseline+" and first_of_length else {}
            extra = {
                "top1_agreement": float(top1.float().mean()),
                "prompt_kv_bytes_kept": run.prompt_kv_bytes_kept,
                "low_rank_state_bytes": run.policy_stats().get("low_rank_state_bytes", 0),
                "kept_tokens": run.kept_tokens_per_layer[0],
                "heldout_start": starts[index],
                "heldout_text": text,
                **timing,
            }
            records.append(
                _record(engine, method, role, length, index, prompt, continuation, float(kl.mean()), _perplexity(logits, continuation), full_ppl, run, extra)
            )
            bar.update()
    bar.close()
    return records


def _decode_timing(engine, prompt: list[int], policy, tokens: int) -> dict[str, Any]:
    if tokens < 2:
        return {}
    decoded = engine.token_run(prompt, compression=policy, max_new_tokens=tokens).decode()
    return {"decode_ms_per_token": decoded["decode_ms_per_token"], "low_rank_ms_per_step": decoded.get("low_rank_ms_per_step")}


def _record(engine, method: Method, role: str, length, index, prompt, continuation, kl, ppl, full_ppl, run, extra) -> Record:
    return {
        **common_fields(engine, "fidelity", method, len(prompt)),
        "prompt_source": "heldout",
        "role": role,
        "target_tokens": length,
        "prompt_index": index,
        "continuation_tokens": len(continuation),
        "kl_mean": kl,
        "perplexity": ppl,
        "full_perplexity": full_ppl,
        **extra,
    }

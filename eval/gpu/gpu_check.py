"""The prepared GPU check (issue 63): what a GPU run must confirm, in order of value, under a time limit.

A GPU machine is lent now and then for a few minutes (one H100 or H200, no network; see
shared/design/gpu.md), so everything it should measure is in this one script, built and tested on
the CPU first (``--tiny``, which CI runs). Each part checks the clock before it starts (and between
sizes); a part that does not fit is recorded as ``skipped: time limit``, a part that raises is
recorded with its error (traceback in ``gpu_check.log``) and the script goes on. It exits 0 unless
its arguments are bad. One record per part in ``OUT/records.jsonl``, each naming the device, the
torch and transformers versions, the date and the command; ``OUT/table.md`` shows them.

Parts, full mode (``--tiny``: the same with tiny shapes, see ``TINY``):

1. preflight: versions, device name and memory, bf16 support, that ``model(..., cache=)`` fills
   the cache (transformers >= 5.24), a tiny engine's ``info()`` and a short generate on the device.
2. device_vs_cpu: the tiny models of every family of :mod:`snapkv_rag.testing`, fp32 on the device
   against fp32 on the CPU, same weights: greedy tokens (first divergence), kept entries per layer and
   the largest teacher-forced logit gap (``engine.score``) for full, SnapKV, H2O, StreamingLLM, random,
   ``kv_bits``, decode-time cuts, rolling, drafts, a padded ``generate_batch`` and a prefix-cache repeat.
3. decode_speed: a Llama-3.1-8B-shaped random-weight model in bf16 (built on the device from its
   config, no download), 16K and 32K prompts, batch 1, 2 and 8, full cache against SnapKV
   1024/2048/4096: decode ms per token timed by this script with CUDA events around each model
   forward, beside the engine's own stats and each configuration's bandwidth floor (weight bytes
   plus K/V bytes read per step, over a measured device-to-device copy bandwidth). Combinations
   that cannot fit in memory are skipped with the estimate, ones that run out are recorded so.
4. prefill_memory: the 32K prefill's peak (``torch.cuda.reset_peak_memory_stats``, then the peak
   minus the post-load baseline), full cache against SnapKV 1024, prefix cache on and off.
5. rolling_prefill: 64K and 128K prompts under ``rolling=``: peak memory, time per prompt token, decode after.
6. kv_reuse_drafts: ``kv_bits`` 8/4 decode at 32K, time to first token of a repeated prompt (prefix
   reuse), prompt-lookup drafts, and a forward of 1+k tokens against one at 32K.
7. concurrency_oom: 32 concurrent requests from threads, then a forced out-of-memory (a batch of
   16K prompts whose prefill needs twice the device's memory) that must raise, a leak check, and a
   small generate that must still work.
8. training: ``snapkv_rag.adapter_training.train.tune`` for a few steps on a Llama-3.2-1B shape and on the 8B
   shape: tokens/s and peak memory.

On a CPU (``--tiny --device cpu``) the device is the CPU: part 2 compares the CPU with itself (the
tokens must be equal), synchronisation is a no-op and memory figures are the engine's own (RSS).

The GPU machine has Python 3.12, torch 2.11, transformers 5.17 and no network; this project needs
transformers >= 5.24 (the ``cache=`` keyword). Download, here, the wheels it needs newer than that
machine has or may lack (the versions of .venv: transformers and what it checks at import, the hub's
HTTP client, and jsonschema for the ``tune`` data of part 8; 19 wheels, about 23 MB) into ``.whl/``,
which git ignores, so it must be named among the ignored paths that travel with the tree::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 kernels==0.19.1 regex==2026.12.2 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 anyio==4.16.0 h11==0.16.0 idna==3.21 sniffio==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 peft==0.21.2

Then run there (``.site/`` is git-ignored too). The parts are estimated at 3-5 minutes there; with
``--time-limit 480`` the install and the imports still fit in one 600-second command, and the parts
that do not fit are recorded as skipped, so a first run always leaves records::

    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl && PYTHONPATH=.site:. python3 -m eval gpu_check --device cuda --time-limit 480 --out "$OUT/gpu_check"

What the machine is assumed to have already (torch's and transformers 5.17's own dependencies:
numpy, packaging, pyyaml, tqdm, filelock, fsspec, jinja2, psutil, accelerate) was checked on a CPU:
a bare virtualenv with only those, the wheels above installed with ``--target``, runs ``--tiny``
through every part (matplotlib, for ``tune``'s loss plot, may be missing: part 8 notes it).

On a CPU, as CI does::

    .venv/bin/python -m eval gpu_check --tiny --device cpu --out eval/gpu/results/cpu_tiny
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from eval.common.results_io import write_records, write_table

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")  # the families snapkv_rag.testing builds
GIB = 1 << 30
# Llama 3's rotary scaling (the 8B's factor 8, the 1B's 32), so rolling= moves keys with the real rotation
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Sizes:
    """The shapes of one mode (full on a GPU, tiny on a CPU)."""

    # part 2: tiny models of every family, the device against the CPU
    compare_prompt_tokens: int
    compare_new_tokens: int
    compare_budget: int
    compare_window: int
    compare_rolling: int
    # parts 3-7: the big model (the 8B shape, or a tiny stand-in)
    speed_lengths: tuple[int, int]
    speed_batches: tuple[int, int, int]
    speed_budgets: tuple[int, ...]
    speed_window: int
    new_tokens: int
    memory_length: int
    rolling_lengths: tuple[int, ...]
    rolling_chunk: int
    kv_length: int
    draft_widths: tuple[int, ...]
    concurrent: int
    concurrent_prompt_tokens: int
    oom_batch: int
    # part 8
    train_steps: int
    train_accumulate: int
    train_max_tokens: int
    copy_bytes: int  # the tensor copied to measure bandwidth
    # seconds a part needs at least before it is started (the time limit's check)
    estimates: dict[str, float] = field(default_factory=dict)


FULL = Sizes(
    compare_prompt_tokens=1500,
    compare_new_tokens=24,
    compare_budget=256,
    compare_window=32,
    compare_rolling=512,
    speed_lengths=(16384, 32768),
    speed_batches=(1, 2, 8),
    speed_budgets=(1024, 2048, 4096),
    speed_window=32,
    new_tokens=20,
    memory_length=32768,
    rolling_lengths=(65536, 131072),
    rolling_chunk=2048,
    kv_length=32768,
    draft_widths=(1, 5, 9),
    concurrent=32,
    concurrent_prompt_tokens=1024,
    oom_batch=64,
    train_steps=3,
    train_accumulate=2,
    train_max_tokens=4096,
    copy_bytes=1 << 30,
    estimates={
        "preflight": 5,
        "device_vs_cpu": 20,
        "decode_speed": 40,
        "compiled_decode": 60,
        "prefill_memory": 10,
        "rolling_prefill": 15,
        "kv_reuse_drafts": 15,
        "concurrency_oom": 10,
        "training": 20,
    },
)

TINY = Sizes(
    compare_prompt_tokens=300,
    compare_new_tokens=6,
    compare_budget=64,
    compare_window=16,
    compare_rolling=128,
    speed_lengths=(256, 512),
    speed_batches=(1, 2, 8),
    speed_budgets=(32, 64, 128),
    speed_window=16,
    new_tokens=3,
    memory_length=512,
    rolling_lengths=(1024, 2048),
    rolling_chunk=128,
    kv_length=512,
    draft_widths=(1, 5, 9),
    concurrent=32,
    concurrent_prompt_tokens=64,
    oom_batch=64,
    train_steps=2,
    train_accumulate=2,
    train_max_tokens=4096,
    copy_bytes=64 << 20,
)


class Skip(Exception):
    """A part (or a row) that cannot run here; its message is the reason."""


# --------------------------------------------------------------------------- the run
class Check:
    """What the parts share: the arguments, the clock, the log, the tokenizer and the big model."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tiny = args.tiny
        self.sizes = TINY if args.tiny else FULL
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.deadline = time.monotonic() + args.time_limit
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "gpu_check.log"
        self.log_path.write_text("")
        self.loaded_tokenizer: Any = None
        self.big_model: Big | None = None
        self.passages: dict[tuple[int, str], str] = {}

    # the clock
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return self.left() > max(0.0, seconds)

    # the device
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def clean(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.cuda else rss_bytes()

    def available(self) -> int:
        """Device memory a new allocation can still take (free plus what torch holds unused)."""
        if not self.cuda:
            return 1 << 62
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device))

    def log(self, message: str) -> None:
        with self.log_path.open("a") as fh:
            fh.write(message.rstrip() + "\n")
        print(f"gpu_check: {message.splitlines()[0] if message.strip() else ''}", file=sys.stderr, flush=True)

    # what several parts use
    @property
    def tokenizer(self):
        if self.loaded_tokenizer is None:
            from snapkv_rag.testing import build_tokenizer

            self.loaded_tokenizer = build_tokenizer()
        return self.loaded_tokenizer

    def passage(self, tokens: int, lead: str = "") -> str:
        """A prompt text of about ``tokens`` tokens of the tiny tokenizer (the tests' sentences, repeated)."""
        key = (tokens, lead)
        if key not in self.passages:
            from snapkv_rag.testing import CORPUS

            tok = self.tokenizer
            unit = " ".join(CORPUS) + " "
            per = len(tok(unit, add_special_tokens=False)["input_ids"])
            ids = tok(unit * (tokens // per + 2), add_special_tokens=False)["input_ids"]
            lead_tokens = len(tok(lead, add_special_tokens=False)["input_ids"]) if lead else 0
            self.passages[key] = lead + tok.decode(ids[: max(1, tokens - lead_tokens)])
        return self.passages[key]

    def big(self) -> Big:
        if self.big_model is None:
            self.big_model = build_big(self)
        if self.big_model.spent:
            raise Skip("the big model was given to training (LoRA layers added)")
        return self.big_model


def rss_bytes() -> int:
    from snapkv_rag.model.peak_memory import current_rss_bytes

    return current_rss_bytes()


# --------------------------------------------------------------------------- models
def llama_config(shape: str, vocab_size: int = 128256):
    """A Llama-3.1-8B or Llama-3.2-1B config (random weights; the tiny tokenizer's special ids)."""
    from transformers import LlamaConfig

    common = dict(vocab_size=vocab_size, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=8, pad_token_id=3, head_dim=None)
    if shape == "8b":
        sizes = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336)
        return LlamaConfig(**{**common, **sizes}, tie_word_embeddings=False, rope_parameters={**LLAMA3_ROPE, "factor": 8.0})
    sizes = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192)
    return LlamaConfig(**{**common, **sizes}, tie_word_embeddings=True, rope_parameters={**LLAMA3_ROPE, "factor": 32.0})


def build_model(check: Check, shape: str, seed: int = 0):
    """``shape`` ("8b", "1b") in bf16 on the device, built from its config; in tiny mode a tiny
    random Llama in fp32 stands in for either."""
    from transformers import AutoModelForCausalLM

    from snapkv_rag.testing import tiny_config

    torch.manual_seed(seed)
    if check.tiny:
        config, dtype = tiny_config("llama", len(check.tokenizer), context=4096), torch.float32
    else:
        config, dtype = llama_config(shape), torch.bfloat16
    with torch.device(check.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def weight_bytes(model) -> tuple[int, int]:
    """(all weight bytes, the bytes a decode step reads: all but the input embedding table, unless tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = emb is out or (emb.device.type != "meta" and emb.data_ptr() == out.data_ptr())
    read = total if tied else total - emb.numel() * emb.element_size()
    return total, read


@dataclass
class Big:
    """The big model of parts 3-7 (the 8B shape, or a tiny stand-in) and its engine."""

    model: Any
    engine: Any
    label: str
    load_seconds: float
    baseline_bytes: int  # memory in use after the load (device allocator, or process RSS on a CPU)
    weight_bytes: int
    weight_bytes_read: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int  # a rough prefill transient per prompt token (the MLP and the hidden states)
    layers: int
    spent: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.label,
            "load_seconds": round(self.load_seconds, 2),
            "weights_gib": round(self.weight_bytes / GIB, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "baseline_gib": round(self.baseline_bytes / GIB, 3),
        }


def build_big(check: Check) -> Big:
    from snapkv_rag import Engine

    check.log("building the big model" + (" (tiny stand-in)" if check.tiny else " (Llama-3.1-8B shape, bf16)"))
    start = time.perf_counter()
    model = build_model(check, "8b")
    check.sync()
    seconds = time.perf_counter() - start
    label = "tiny llama (stand-in for the 8B shape)" if check.tiny else "Llama-3.1-8B shape, random bf16"
    engine = Engine(model, check.tokenizer, name=label)
    engine.generate("Warm up the kernels.", chat=False, max_new_tokens=2, ignore_eos=True, prefix_cache=False)
    check.clean()
    info = engine.info()
    total, read = weight_bytes(model)
    config = model.config
    act = (6 * config.hidden_size + 4 * config.intermediate_size) * model.dtype.itemsize
    return Big(model, engine, label, seconds, check.allocated(), total, read, info.kv_bytes_per_token, act, info.num_layers)


# --------------------------------------------------------------------------- timing
class ForwardTimes:
    """Times every forward of ``model`` while open: CUDA events recorded around each call on CUDA
    (no host synchronisation, so the engine's own timings are not disturbed), ``perf_counter`` on a CPU."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.cuda = device.type == "cuda"
        self.calls: list[tuple[tuple[int, ...], Any, Any]] = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def between(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def __enter__(self) -> ForwardTimes:
        original = self.model.forward

        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else ()
            start = self.mark()
            out = original(*args, **kwargs)
            self.calls.append((shape, start, self.mark()))
            return out

        self.model.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward
        if self.cuda:
            torch.cuda.synchronize()

    def summary(self, decode_steps: int) -> dict[str, Any]:
        """The prefill (every forward before the last ``decode_steps``) and the decode forwards: the
        prefill's seconds, each decode forward's median (the first excluded, as the engine does) and
        the wall time per decode forward from the first one's start to the last one's end (sampling
        and detokenisation between forwards included)."""
        if not self.calls:
            return {}
        split = len(self.calls) - decode_steps if 0 < decode_steps <= len(self.calls) else len(self.calls)
        prefill, decode = self.calls[:split], self.calls[split:]
        out: dict[str, Any] = {"forwards": len(self.calls)}
        if prefill:
            out["prefill_s"] = self.between(prefill[0][1], prefill[-1][2])
        if decode:
            steps = [self.between(s, e) * 1000 for _, s, e in decode]
            out["decode_ms"] = statistics.median(steps[1:] or steps)
            out["step_ms"] = self.between(decode[0][1], decode[-1][2]) * 1000 / len(decode)
            out["decode_widths"] = sorted({shape[1] for shape, _, _ in decode if len(shape) > 1})
        return out


def copy_bandwidth(check: Check) -> float:
    """Bytes moved per second (read plus written) by a large synchronised device-to-device copy."""
    n = check.sizes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=check.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    check.sync()
    reps = 3 if check.tiny else 10
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    check.sync()
    seconds = time.perf_counter() - start
    del src, dst
    return 2 * n * reps / seconds


@dataclass
class Peak:
    """A call's peak memory: the allocator's on CUDA (reset before), the engine's own figure on a CPU (RSS)."""

    check: Check
    before: int = 0

    def __enter__(self) -> Peak:
        self.check.clean()
        self.before = self.check.allocated()
        if self.check.cuda:
            torch.cuda.reset_peak_memory_stats(self.check.device)
        return self

    def __exit__(self, *exc) -> None:
        self.check.sync()

    def figures(self, stats, baseline: int) -> dict[str, Any]:
        """The peak over the post-load ``baseline`` and over the memory in use when the call began."""
        peak = int(torch.cuda.max_memory_allocated(self.check.device)) if self.check.cuda else int(stats.peak_memory_bytes)
        return {
            "peak_over_load_gib": round((peak - baseline) / GIB, 4),
            "peak_over_start_gib": round((peak - self.before) / GIB, 4),
            "held_after_gib": round((self.check.allocated() - self.before) / GIB, 4) if self.check.cuda else None,
            "engine_peak_gib": round(stats.peak_memory_bytes / GIB, 4),
            "engine_peak_added_gib": round(getattr(stats, "peak_memory_added_bytes", 0) / GIB, 4) if hasattr(stats, "peak_memory_added_bytes") else None,
            "peak_kind": "cuda allocator" if self.check.cuda else f"engine ({stats.peak_memory_kind})",
        }


def timed(check: Check, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its synchronised wall seconds."""
    check.sync()
    start = time.perf_counter()
    value = fn()
    check.sync()
    return value, time.perf_counter() - start


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit] if text else ''}"


def divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- 1. preflight
def preflight(check: Check) -> dict[str, Any]:
    import importlib.metadata as metadata

    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for dist in ("torch", "transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "peft", "kernels", "snapkv-rag"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "not installed"
        rows.append({"item": dist, "value": version})
    import transformers

    where = Path(transformers.__file__).resolve().parent
    rows.append({"item": "transformers imported from", "value": str(where.relative_to(Path.cwd()) if where.is_relative_to(Path.cwd()) else where)})
    rows.append({"item": "python", "value": platform.python_version()})
    rows.append({"item": "torch cuda build", "value": torch.version.cuda})
    rows.append({"item": "cuda available", "value": torch.cuda.is_available()})
    info: dict[str, Any] = {}
    try:
        info = device_checks(check, rows, problems)
    except Exception as exc:  # the versions above are still worth recording
        problems.append(first_line(exc))
        check.log(f"preflight: {traceback.format_exc()}")
    summary = {r["item"]: r["value"] for r in rows if r["item"] in ("device", "transformers", "bf16 supported", "device memory (GiB)")}
    return {"summary": summary, "rows": rows, "columns": ["item", "value"], "problems": problems, "engine_info": info}


def device_checks(check: Check, rows: list[dict[str, Any]], problems: list[str]) -> dict[str, Any]:
    """The preflight's device rows: the device, that ``cache=`` fills the cache, a tiny engine's info and generate."""
    import transformers
    from transformers import DynamicCache

    from snapkv_rag import Engine
    from snapkv_rag.testing import tiny_model

    if check.cuda:
        props = torch.cuda.get_device_properties(check.device)
        rows += [
            {"item": "device", "value": props.name},
            {"item": "device memory (GiB)", "value": round(props.total_memory / GIB, 1)},
            {"item": "compute capability", "value": f"{props.major}.{props.minor}"},
            {"item": "multiprocessors", "value": props.multi_processor_count},
            {"item": "bf16 supported", "value": torch.cuda.is_bf16_supported()},
            {"item": "fp32 matmul precision", "value": torch.get_float32_matmul_precision()},
        ]
    else:
        rows += [
            {"item": "device", "value": "cpu"},
            {"item": "cpu cores", "value": os.cpu_count()},
            {"item": "torch threads", "value": torch.get_num_threads()},
        ]
    tok = check.tokenizer
    model = tiny_model("llama", len(tok)).to(check.device)
    ids = tok("Hello world, hello engine!", return_tensors="pt")["input_ids"].to(check.device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    filled = cache.get_seq_length()
    rows.append({"item": "model(..., cache=) fills the cache", "value": f"{filled} of {ids.shape[1]} tokens"})
    if filled != ids.shape[1]:
        problems.append(f"model(..., cache=) left {filled} of {ids.shape[1]} tokens in the cache: transformers {transformers.__version__} is older than 5.24?")
    engine = Engine(model, tok, name="tiny-llama")
    info = engine.info().to_dict()
    result = engine.generate("Hello", max_new_tokens=3, ignore_eos=True, compression="snapkv:budget=16,window=4")
    rows.append({"item": "engine info()", "value": ", ".join(f"{k}={v}" for k, v in info.items())})
    rows.append({"item": "tiny generate", "value": f"{result.token_ids} on {result.stats.device} ({result.stats.dtype})"})
    if result.stats.device != str(check.device) and not str(result.stats.device).startswith(check.device.type):
        problems.append(f"the engine ran on {result.stats.device}, not {check.device}")
    return info


# --------------------------------------------------------------------------- 2. device against CPU fp32
def compare_cases(s: Sizes) -> list[tuple[str, str | None, dict[str, Any]]]:
    from snapkv_rag.compression import SnapKV

    b, w, r = s.compare_budget, s.compare_window, s.compare_rolling
    snap = SnapKV(max_capacity_prompt=b, window_size=w)
    return [
        ("full", None, {}),
        ("snapkv", snap.spec(), {}),
        ("h2o", f"h2o:budget={b}", {}),
        ("streaming", f"streaming:budget={b}", {}),
        ("random", f"random:budget={b}", {}),
        ("snapkv kv_bits=8", snap.with_bits(8).spec(), {}),
        ("full kv_bits=4", "full:kv_bits=4", {}),
        ("snapkv decode cuts", snap.with_settings(decode_budget=b + w, decode_interval=2).spec(), {}),
        ("snapkv rolling", snap.with_rolling(r).spec(), {}),
        ("drafts (full cache)", None, {"prompt_lookup_num_tokens": 4}),
    ]


def device_vs_cpu(check: Check) -> dict[str, Any]:
    from snapkv_rag import Engine
    from snapkv_rag.testing import tiny_model

    s, tok = check.sizes, check.tokenizer
    prompt = check.passage(s.compare_prompt_tokens)
    short = check.passage(s.compare_prompt_tokens * 2 // 3, lead="A shorter one. ")
    repeat = check.passage(s.compare_prompt_tokens, lead="Asked twice. ")
    gen = dict(chat=False, max_new_tokens=s.compare_new_tokens, ignore_eos=True)
    context = 4096
    rows: list[dict[str, Any]] = []
    for family in FAMILIES:
        if not check.fits(0):
            rows.append({"family": family, "case": "*", "status": "skipped: time limit"})
            continue
        reference = Engine(tiny_model(family, len(tok), context=context), tok, name=f"tiny-{family}")
        tested = Engine(tiny_model(family, len(tok), context=context).to(check.device), tok, name=f"tiny-{family}")
        full_tokens: list[int] = []
        for label, spec, extra in compare_cases(s):
            row: dict[str, Any] = {"family": family, "case": label, "spec": spec or "full"}
            try:
                a = reference.generate(prompt, compression=spec, prefix_cache=False, **gen, **extra)
                b = tested.generate(prompt, compression=spec, prefix_cache=False, **gen, **extra)
                first = divergence(a.token_ids, b.token_ids)
                row.update(status="ok", equal=first is None, first_divergence=first, kept_equal=a.stats.kept_tokens_per_layer == b.stats.kept_tokens_per_layer)
                row["kept"] = b.stats.kept_tokens_per_layer[0] if b.stats.kept_tokens_per_layer else None
                if label == "full":
                    full_tokens = b.token_ids
                if extra:
                    row["same_as_full_cache"] = b.token_ids == full_tokens
                    drafts = b.stats.drafts or {}
                    row["note"] = ", ".join(f"{k}={v}" for k, v in drafts.items() if not isinstance(v, (dict, list)))
                else:
                    la = reference.score(prompt, a.token_ids, chat=False, compression=spec, prefix_cache=False)
                    lb = tested.score(prompt, a.token_ids, chat=False, compression=spec, prefix_cache=False)
                    row["max_logit_gap"] = float((la.float().cpu() - lb.float().cpu()).abs().max())
            except Exception as exc:
                row.update(status="error", error=first_line(exc))
                check.log(f"device_vs_cpu {family} {label}: {traceback.format_exc()}")
            rows.append(row)
        row = {"family": family, "case": "padded generate_batch", "spec": f"snapkv:budget={s.compare_budget},window={s.compare_window}"}
        try:
            batch = dict(gen, compression=row["spec"], bucket=False, prefix_cache=False)
            ra = reference.generate_batch([prompt, short], **batch)
            rb = tested.generate_batch([prompt, short], **batch)
            firsts = [divergence(x.token_ids, y.token_ids) for x, y in zip(ra, rb)]
            diverged = [f for f in firsts if f is not None]
            row.update(status="ok", equal=not diverged, first_divergence=min(diverged) if diverged else None)
            row["kept_equal"] = all(x.stats.kept_tokens_per_layer == y.stats.kept_tokens_per_layer for x, y in zip(ra, rb))
            row["note"] = f"rows of {ra[0].usage.prompt_tokens} and {ra[1].usage.prompt_tokens} tokens padded to {rb[0].stats.prompt_tokens_padded}"
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"device_vs_cpu {family} batch: {traceback.format_exc()}")
        rows.append(row)
        row = {"family": family, "case": "prefix-cache repeat", "spec": "full"}
        try:
            runs = []
            for engine in (reference, tested):
                engine.prefix_cache.clear()
                runs.append([engine.generate(repeat, prefix_cache=True, **gen) for _ in range(2)])
            (a1, a2), (b1, b2) = runs
            first = divergence(a2.token_ids, b2.token_ids)
            row.update(status="ok", equal=first is None, first_divergence=first, kept_equal=a2.stats.kept_tokens_per_layer == b2.stats.kept_tokens_per_layer)
            row["same_as_first_read"] = b2.token_ids == b1.token_ids and a2.token_ids == a1.token_ids
            row["note"] = f"second read reused {b2.stats.reused_prompt_tokens} of {b2.usage.prompt_tokens} tokens"
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"device_vs_cpu {family} prefix: {traceback.format_exc()}")
        rows.append(row)
        del reference, tested
        check.clean()
    ran = [r for r in rows if r.get("status") == "ok"]
    gaps = [r["max_logit_gap"] for r in ran if r.get("max_logit_gap") is not None]
    problems: list[str] = []  # (rows with errors fail the part too: main collects them)
    if not check.cuda:  # the CPU against itself: anything but equal is a defect
        problems += [f"{r['family']} {r['case']}: CPU against CPU diverged at {r['first_divergence']}" for r in ran if not r["equal"]]
    summary = {
        "compared": f"{check.device.type} fp32 against cpu fp32",
        "cases": len(rows),
        "equal_tokens": sum(bool(r.get("equal")) for r in ran),
        "diverged": [f"{r['family']}/{r['case']}@{r['first_divergence']}" for r in ran if not r["equal"]],
        "max_logit_gap": max(gaps) if gaps else None,
    }
    columns = ["family", "case", "status", "equal", "first_divergence", "max_logit_gap", "kept_equal", "kept", "note", "error"]
    return {"summary": summary, "rows": rows, "columns": columns, "problems": problems}


# --------------------------------------------------------------------------- 3. decode speed
def case_failed(check: Check, part: str, row: dict[str, Any], exc: Exception) -> None:
    """A case that raised: skipped where the device ran out of memory, else an error (logged)."""
    if isinstance(exc, torch.OutOfMemoryError):
        row["status"] = f"skipped: out of memory ({first_line(exc, 120)})"
    else:
        row.update(status="error", error=first_line(exc))
        check.log(f"{part} {row}: {traceback.format_exc()}")
    check.clean()


def decode_speed(check: Check) -> dict[str, Any]:
    from snapkv_rag.compression import parse_compression

    s, big = check.sizes, check.big()
    bandwidth = copy_bandwidth(check)
    short, long = s.speed_lengths
    one, two, eight = s.speed_batches
    # the paper's figure first (16K, batch 2), then what is cheapest to add
    configs = [(short, two), (short, one), (long, one), (long, two), (short, eight), (long, eight)]
    policies: list[str | None] = [None] + [f"snapkv:budget={b},window={s.speed_window}" for b in s.speed_budgets]
    seconds_per_token = 0.0 if check.tiny else 6e-5  # prefill, updated from each measurement
    rows: list[dict[str, Any]] = []
    for length, batch in configs:
        prompt = check.passage(length)
        big.engine.prefix_cache.clear()
        check.clean()
        for spec in policies:
            budget = None if spec is None else parse_compression(spec).max_capacity_prompt
            row: dict[str, Any] = {"length": length, "batch": batch, "policy": "full" if spec is None else f"snapkv {budget}"}
            rows.append(row)
            # batch 8 is worth less than the parts after this one: it runs only with their time left over
            reserve = later_estimates(check, "decode_speed") if batch == eight else 0.0
            if not check.fits(length * batch * seconds_per_token + 2 + reserve):
                row["status"] = "skipped: time limit"
                continue
            kv = length * batch * big.kv_bytes_per_token
            need = length * batch * big.activation_bytes_per_token + (kv if budget is None else kv // big.layers + batch * budget * big.kv_bytes_per_token)
            if need > 0.95 * check.available():
                row["status"] = f"skipped: needs ~{need / GIB:.0f} GiB, {check.available() / GIB:.0f} GiB free"
                continue
            try:
                with ForwardTimes(big.model, check.device) as times:
                    results, wall = timed(
                        check,
                        lambda spec=spec, batch=batch, prompt=prompt: big.engine.generate_batch(
                            [prompt] * batch, chat=False, compression=spec, max_new_tokens=s.new_tokens, ignore_eos=True, bucket=False, prefix_cache=batch <= 2
                        ),
                    )
            except Exception as exc:
                case_failed(check, "decode_speed", row, exc)
                continue
            stats = results[0].stats
            measured = times.summary(stats.decode_steps)
            per_step = big.weight_bytes_read + stats.batch_prompt_kv_bytes
            floor_ms = per_step / bandwidth * 1000
            row.update(
                status="ok",
                prompt_tokens=results[0].usage.prompt_tokens,
                decode_ms=measured.get("decode_ms"),
                step_ms=measured.get("step_ms"),
                engine_decode_ms=stats.decode_ms_per_token,
                floor_ms=floor_ms,
                over_floor=measured["decode_ms"] / floor_ms if measured.get("decode_ms") else None,
                prefill_s=measured.get("prefill_s"),
                engine_prefill_s=stats.prefill_seconds,
                reused=stats.reused_prompt_tokens,
                kv_gib=stats.batch_prompt_kv_bytes / GIB,
                kept=stats.kept_tokens_per_layer[0] if stats.kept_tokens_per_layer else None,
                wall_s=wall,
                engine_peak_gib=stats.peak_memory_bytes / GIB,
            )
            if measured.get("prefill_s") and not stats.reused_prompt_tokens:
                seconds_per_token = max(seconds_per_token, measured["prefill_s"] / (length * batch))
        check.clean()
    for row in rows:
        full = next((r for r in rows if r["length"] == row["length"] and r["batch"] == row["batch"] and r["policy"] == "full"), None)
        if row.get("decode_ms") and full and full.get("decode_ms"):
            row["speedup"] = full["decode_ms"] / row["decode_ms"]
    paper = next((r for r in rows if r["length"] == short and r["batch"] == two and r["policy"] == f"snapkv {s.speed_budgets[0]}"), {})
    summary = {
        **big.describe(),
        "copy_gb_per_s": round(bandwidth / 1e9, 1),
        f"speedup_{short}_batch{two}_snapkv{s.speed_budgets[0]}": paper.get("speedup"),
        "ran": sum(r.get("status") == "ok" for r in rows),
        "of": len(rows),
    }
    columns = [
        "length",
        "batch",
        "policy",
        "status",
        "decode_ms",
        "engine_decode_ms",
        "step_ms",
        "floor_ms",
        "over_floor",
        "speedup",
        "prefill_s",
        "engine_prefill_s",
        "reused",
        "kv_gib",
        "kept",
        "error",
    ]
    return {"summary": summary, "rows": rows, "columns": columns}


def compiled_decode(check: Check) -> dict[str, Any]:
    """Issue 74's GPU figures: the compiled decode step (CUDA graphs on a GPU) against the eager one on
    the big model, batch 1 and 8, the short and long lengths, the full cache and SnapKV at the first
    budget, each beside its bandwidth floor; greedy tokens compared between the two."""
    from snapkv_rag import Engine

    s, big = check.sizes, check.big()
    bandwidth = copy_bandwidth(check)
    compiled = Engine(big.model, check.tokenizer, name=big.label, compile_decode=True)
    warm, warm_s = timed(check, compiled.warm_compiled_decode)
    rows: list[dict[str, Any]] = []
    short, long = s.speed_lengths
    one, _, eight = s.speed_batches
    new_tokens = max(s.new_tokens, 8)
    for length, batch in [(short, one), (long, one), (short, eight), (long, eight)]:
        prompt = check.passage(length)
        for spec in [f"snapkv:budget={s.speed_budgets[0]},window={s.speed_window}", None]:
            row: dict[str, Any] = {"length": length, "batch": batch, "policy": "full" if spec is None else f"snapkv {s.speed_budgets[0]}"}
            rows.append(row)
            if not check.fits(2 * length * batch * (0.0 if check.tiny else 6e-5) + 4):
                row["status"] = "skipped: time limit"
                continue
            try:
                runs = {}
                for label, engine in (("eager", big.engine), ("compiled", compiled)):
                    engine.prefix_cache.clear()
                    check.clean()
                    runs[label] = engine.generate_batch(
                        [prompt] * batch, chat=False, compression=spec, max_new_tokens=new_tokens, ignore_eos=True, bucket=False, prefix_cache=False
                    )
            except Exception as exc:
                case_failed(check, "compiled_decode", row, exc)
                continue
            eager_ms, compiled_ms = runs["eager"][0].stats.decode_ms_per_token, runs["compiled"][0].stats.decode_ms_per_token
            floor_ms = (big.weight_bytes_read + runs["compiled"][0].stats.batch_prompt_kv_bytes) / bandwidth * 1000
            row.update(
                status="ok",
                eager_ms=eager_ms,
                compiled_ms=compiled_ms,
                floor_ms=floor_ms,
                compiled_over_floor=compiled_ms / floor_ms if compiled_ms else None,
                speedup=eager_ms / compiled_ms if eager_ms and compiled_ms else None,
                decode_step=runs["compiled"][0].stats.decode_step,
                same_tokens=all(a.token_ids == b.token_ids for a, b in zip(runs["eager"], runs["compiled"])),
            )
    check.clean()
    summary = {**compiled.compiled_decode.stats(), "warm_s": round(warm_s, 1), "copy_gb_per_s": round(bandwidth / 1e9, 1)}
    columns = [
        "length",
        "batch",
        "policy",
        "status",
        "eager_ms",
        "compiled_ms",
        "floor_ms",
        "compiled_over_floor",
        "speedup",
        "decode_step",
        "same_tokens",
        "error",
    ]
    return {"summary": summary, "rows": rows, "columns": columns}


def later_estimates(check: Check, name: str) -> float:
    """The seconds the parts after ``name`` need at least (what a low-value size must leave them)."""
    return sum(check.sizes.estimates.get(later, 0.0) for later in PART_NAMES[PART_NAMES.index(name) + 1 :])


# --------------------------------------------------------------------------- 4. prefill peak memory
def prefill_memory(check: Check) -> dict[str, Any]:
    from snapkv_rag import Engine

    s, big = check.sizes, check.big()
    n = s.memory_length
    prompt = check.passage(n)
    without = Engine(big.model, check.tokenizer, name=big.label, prefix_cache_bytes=0)
    rows: list[dict[str, Any]] = []
    for cache_label, engine in (("on (default)", big.engine), ("off (prefix_cache_bytes=0)", without)):
        for spec in (None, f"snapkv:budget={s.speed_budgets[0]},window={s.speed_window}"):
            row: dict[str, Any] = {"prefix_cache": cache_label, "policy": spec or "full"}
            rows.append(row)
            if not check.fits(1):
                row["status"] = "skipped: time limit"
                continue
            engine.prefix_cache.clear()
            try:
                with Peak(check) as peak:
                    result, wall = timed(
                        check, lambda engine=engine, spec=spec: engine.generate(prompt, chat=False, compression=spec, max_new_tokens=2, ignore_eos=True)
                    )
                row.update(
                    status="ok",
                    prompt_tokens=result.usage.prompt_tokens,
                    prefill_s=result.stats.prefill_seconds,
                    wall_s=wall,
                    **peak.figures(result.stats, big.baseline_bytes),
                )
                row["kv_kept_gib"] = result.stats.prompt_kv_bytes_kept / GIB
            except Exception as exc:
                row.update(status="error", error=first_line(exc))
                check.log(f"prefill_memory {row}: {traceback.format_exc()}")
            engine.prefix_cache.clear()
    del without
    summary = {"prompt_tokens": n, "baseline_gib": round(big.baseline_bytes / GIB, 3), "full_prompt_kv_gib": round(n * big.kv_bytes_per_token / GIB, 3)}
    columns = [
        "prefix_cache",
        "policy",
        "status",
        "peak_over_load_gib",
        "peak_over_start_gib",
        "held_after_gib",
        "engine_peak_gib",
        "engine_peak_added_gib",
        "kv_kept_gib",
        "prefill_s",
        "peak_kind",
        "error",
    ]
    return {"summary": summary, "rows": rows, "columns": columns}


# --------------------------------------------------------------------------- 5. rolling prefill
def rolling_prefill(check: Check) -> dict[str, Any]:
    s, big = check.sizes, check.big()
    spec = f"snapkv:budget={s.speed_budgets[0]},window={s.speed_window},rolling={s.rolling_chunk}"
    try:
        big.engine.rope_shift(sliding=True)  # its one-time probe forward, outside the timings
    except Exception as exc:
        check.log(f"rolling_prefill: rope_shift: {first_line(exc)}")
    seconds_per_token = 0.0 if check.tiny else 4e-5
    rows: list[dict[str, Any]] = []
    for n in s.rolling_lengths:
        row: dict[str, Any] = {"length": n, "policy": spec}
        rows.append(row)
        if not check.fits(n * seconds_per_token + 2):
            row["status"] = "skipped: time limit"
            continue
        prompt = check.passage(n)
        try:
            with Peak(check) as peak, ForwardTimes(big.model, check.device) as times:
                result, wall = timed(
                    check,
                    lambda prompt=prompt: big.engine.generate(
                        prompt, chat=False, compression=spec, max_new_tokens=s.new_tokens, ignore_eos=True, prefix_cache=False
                    ),
                )
            stats = result.stats
            measured = times.summary(stats.decode_steps)
            row.update(
                status="ok",
                prompt_tokens=result.usage.prompt_tokens,
                prefill_s=measured.get("prefill_s"),
                us_per_token=measured["prefill_s"] / result.usage.prompt_tokens * 1e6 if measured.get("prefill_s") else None,
                engine_prefill_s=stats.prefill_seconds,
                decode_ms=measured.get("decode_ms"),
                engine_decode_ms=stats.decode_ms_per_token,
                kept=stats.kept_tokens_per_layer[0] if stats.kept_tokens_per_layer else None,
                forwards=measured.get("forwards"),
                wall_s=wall,
                **peak.figures(stats, big.baseline_bytes),
            )
            row["note"] = ", ".join(f"{k}={v}" for k, v in stats.policy_stats.items() if k.startswith("roll"))
            if measured.get("prefill_s"):
                seconds_per_token = max(seconds_per_token, measured["prefill_s"] / n)
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"rolling_prefill {n}: {traceback.format_exc()}")
        check.clean()
    columns = [
        "length",
        "status",
        "prompt_tokens",
        "prefill_s",
        "us_per_token",
        "engine_prefill_s",
        "peak_over_load_gib",
        "engine_peak_gib",
        "decode_ms",
        "kept",
        "note",
        "error",
    ]
    return {"summary": {"policy": spec, "model": big.label}, "rows": rows, "columns": columns}


# --------------------------------------------------------------------------- 6. kv_bits, prefix reuse, drafts
def forward_costs(check: Check, big: Big, ids: list[int], widths: tuple[int, ...], reps: int) -> dict[int, float]:
    """Milliseconds of one forward of ``w`` new tokens over a cache of ``ids`` (median of ``reps``), on the engine's worker."""
    from transformers import DynamicCache

    from snapkv_rag.engine.lookup import drop_last

    model, device = big.model, check.device

    def work() -> dict[int, float]:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            prompt = torch.tensor([ids], device=device)
            model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
            base = cache.get_seq_length()
            out = {}
            for w in widths:
                new = prompt[:, :w]
                positions = torch.arange(base, base + w, device=device)[None]
                times = []
                for _ in range(reps):
                    check.sync()
                    start = time.perf_counter()
                    model(input_ids=new, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=w)
                    check.sync()
                    times.append((time.perf_counter() - start) * 1000)
                    drop_last(cache, w)  # the engine's own removal of rejected draft entries
                out[w] = statistics.median(times)
            return out

    return big.engine.run_on_model(work)


def kv_reuse_drafts(check: Check) -> dict[str, Any]:
    s, big = check.sizes, check.big()
    n, budget, window = s.kv_length, s.speed_budgets[0], s.speed_window
    prompt = check.passage(n)
    snap = f"snapkv:budget={budget},window={window}"
    rows: list[dict[str, Any]] = []
    big.engine.prefix_cache.clear()
    baseline_tokens: dict[str, list[int]] = {}
    for spec in ("full", "full:kv_bits=8", "full:kv_bits=4", snap, f"{snap},kv_bits=8", f"{snap},kv_bits=4"):
        row: dict[str, Any] = {"what": "kv_bits decode", "spec": spec}
        rows.append(row)
        if not check.fits(2):
            row["status"] = "skipped: time limit"
            continue
        try:
            with ForwardTimes(big.model, check.device) as times:
                result = big.engine.generate(prompt, chat=False, compression=None if spec == "full" else spec, max_new_tokens=s.new_tokens, ignore_eos=True)
            stats = result.stats
            measured = times.summary(stats.decode_steps)
            base = spec.replace(",kv_bits=8", "").replace(",kv_bits=4", "").replace(":kv_bits=8", "").replace(":kv_bits=4", "")
            baseline_tokens.setdefault(spec, result.token_ids)
            same = divergence(baseline_tokens.get(base, result.token_ids), result.token_ids)
            row.update(
                status="ok",
                prompt_tokens=result.usage.prompt_tokens,
                decode_ms=measured.get("decode_ms"),
                engine_decode_ms=stats.decode_ms_per_token,
                kv_kept_gib=stats.prompt_kv_bytes_kept / GIB,
                reused=stats.reused_prompt_tokens,
                note="same tokens as full width" if same is None else f"differs from full width at token {same}",
            )
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"kv_reuse_drafts {spec}: {traceback.format_exc()}")
    again = check.passage(n, lead="Read again. ")
    for spec, reads in ((None, 2), (snap, 3)):
        big.engine.prefix_cache.clear()
        check.clean()
        for read in range(1, reads + 1):
            row = {"what": "time to first token", "spec": spec or "full", "read": read}
            rows.append(row)
            if not check.fits(2):
                row["status"] = "skipped: time limit"
                continue
            try:
                result, wall = timed(check, lambda spec=spec: big.engine.generate(again, chat=False, compression=spec, max_new_tokens=1, ignore_eos=True))
                row.update(
                    status="ok",
                    prompt_tokens=result.usage.prompt_tokens,
                    ttft_s=wall,
                    engine_prefill_s=result.stats.prefill_seconds,
                    reused=result.stats.reused_prompt_tokens,
                )
            except Exception as exc:
                row.update(status="error", error=first_line(exc))
                check.log(f"kv_reuse_drafts ttft: {traceback.format_exc()}")
    big.engine.prefix_cache.clear()
    check.clean()
    row = {"what": "drafts", "spec": "full, prompt_lookup_num_tokens=4"}
    rows.append(row)
    if check.fits(2):
        try:
            with ForwardTimes(big.model, check.device) as times:
                result = big.engine.generate(prompt, chat=False, max_new_tokens=s.new_tokens, ignore_eos=True, prompt_lookup_num_tokens=4, prefix_cache=False)
            measured = times.summary(result.stats.decode_steps)
            drafts = result.stats.drafts or {}
            row.update(
                status="ok",
                prompt_tokens=result.usage.prompt_tokens,
                decode_ms=measured.get("decode_ms"),
                engine_decode_ms=result.stats.decode_ms_per_token,
                note=", ".join(f"{k}={v}" for k, v in drafts.items() if not isinstance(v, (dict, list))) + f"; forward widths {measured.get('decode_widths')}",
            )
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"kv_reuse_drafts drafts: {traceback.format_exc()}")
    else:
        row["status"] = "skipped: time limit"
    row = {"what": "forward of 1+k tokens", "spec": f"widths {list(s.draft_widths)} over {n} cached tokens"}
    rows.append(row)
    if check.fits(2):
        try:
            ids = check.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            costs = forward_costs(check, big, ids, s.draft_widths, reps=3 if check.tiny else 5)
            one = costs[s.draft_widths[0]]
            row.update(status="ok", decode_ms=one, note="; ".join(f"{w} tokens: {ms:.3g} ms ({ms / one:.2f}x)" for w, ms in costs.items()))
            row["forward_ms"] = {str(w): ms for w, ms in costs.items()}
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"kv_reuse_drafts forwards: {traceback.format_exc()}")
    else:
        row["status"] = "skipped: time limit"
    check.clean()
    ttft = {r["read"]: r.get("ttft_s") for r in rows if r["what"] == "time to first token" and r["spec"] == "full"}
    summary = {"prompt_tokens": n, "ttft_first_s": ttft.get(1), "ttft_repeat_s": ttft.get(2)}
    columns = ["what", "spec", "read", "status", "decode_ms", "engine_decode_ms", "ttft_s", "engine_prefill_s", "reused", "kv_kept_gib", "note", "error"]
    return {"summary": summary, "rows": rows, "columns": columns}


# --------------------------------------------------------------------------- 7. concurrency and a forced OOM
class InjectedOOM:
    """On a CPU, where a real out-of-memory would take the machine down: the model's forward raises
    ``torch.OutOfMemoryError`` for batches of ``rows`` or more while open (the engine's handling is what is checked)."""

    def __init__(self, model, rows: int):
        self.model, self.rows = model, rows

    def __enter__(self) -> InjectedOOM:
        original = self.model.forward

        def forward(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.shape[0] >= self.rows:
                raise torch.OutOfMemoryError(f"injected: a forward of {ids.shape[0]} rows (gpu_check's CPU stand-in for a real out-of-memory)")
            return original(*args, **kwargs)

        self.model.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward


def concurrency_oom(check: Check) -> dict[str, Any]:
    s, big = check.sizes, check.big()
    engine = big.engine
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    prompts = [check.passage(s.concurrent_prompt_tokens, lead=f"Request {i}. ") for i in range(s.concurrent)]
    specs = [None if i % 2 == 0 else f"snapkv:budget={s.speed_budgets[0]},window={s.speed_window}" for i in range(s.concurrent)]
    engine.prefix_cache.clear()

    def one(i: int):
        return engine.generate(prompts[i], chat=False, compression=specs[i], max_new_tokens=s.new_tokens * 4, ignore_eos=True)

    outcomes: list[Any] = []

    def all_at_once():
        with ThreadPoolExecutor(max_workers=s.concurrent) as pool:
            futures = [pool.submit(one, i) for i in range(s.concurrent)]
            for f in futures:
                try:
                    outcomes.append(f.result())
                except Exception as exc:
                    outcomes.append(exc)

    _, wall = timed(check, all_at_once)
    done = [o for o in outcomes if not isinstance(o, Exception)]
    failed = [first_line(o) for o in outcomes if isinstance(o, Exception)]
    tokens = sum(r.usage.completion_tokens for r in done)
    rows.append(
        {
            "what": f"{s.concurrent} concurrent requests (threads; half full cache, half SnapKV)",
            "status": "ok" if not failed else "error",
            "result": f"{len(done)} done, {len(failed)} failed",
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else None,
            "note": f"most rows decoded together: {max((r.stats.decode_batch_rows_max for r in done), default=0)}; scheduler {engine.scheduler_stats()}",
            "error": "; ".join(sorted(set(failed)))[:300] or None,
        }
    )
    engine.prefix_cache.clear()
    check.clean()
    before = check.allocated()
    length, batch = s.speed_lengths[0], s.oom_batch
    if check.cuda:  # enough rows that the prefill's activations alone are twice the device's memory
        total = torch.cuda.get_device_properties(check.device).total_memory
        batch = max(batch, -(-2 * total // (length * big.activation_bytes_per_token)))
    absurd = check.passage(length)
    row: dict[str, Any] = {"what": f"forced out-of-memory: a batch of {batch} x {length} tokens"}
    rows.append(row)
    injected = InjectedOOM(big.model, rows=2) if not check.cuda else None  # only the absurd batch runs meanwhile
    try:
        if injected is not None:
            injected.__enter__()
        engine.generate_batch([absurd] * batch, chat=False, max_new_tokens=2, ignore_eos=True, bucket=False, prefix_cache=False)
        row.update(status="error", result="no exception: the batch ran")
        problems.append("the absurd batch did not fail")
    except Exception as exc:
        row.update(status="ok", result=first_line(exc, 200), note="injected on the CPU" if injected is not None else "a real CUDA out-of-memory")
        if not isinstance(exc, torch.OutOfMemoryError):
            row["note"] += f"; raised {type(exc).__name__}, not torch.OutOfMemoryError"
    finally:
        if injected is not None:
            injected.__exit__()
    check.clean()
    after = check.allocated()
    row["leaked_gib"] = (after - before) / GIB if check.cuda else None
    if check.cuda and after - before > 64 << 20:
        problems.append(f"{(after - before) / GIB:.2f} GiB still allocated after the out-of-memory")
    row = {"what": "a small generate after it"}
    rows.append(row)
    try:
        result, wall = timed(check, lambda: engine.generate("Still serving?", chat=False, max_new_tokens=4, ignore_eos=True))
        row.update(status="ok", result=f"{len(result.token_ids)} tokens", wall_s=wall)
    except Exception as exc:
        row.update(status="error", error=f"the engine did not serve after the out-of-memory: {first_line(exc)}")
        check.log(f"concurrency_oom after: {traceback.format_exc()}")
    summary = {
        "concurrent_done": len(done),
        "concurrent_tokens_per_s": rows[0]["tokens_per_s"],
        "oom_raised": rows[1]["status"] == "ok",
        "served_after": rows[2]["status"] == "ok",
    }
    return {
        "summary": summary,
        "rows": rows,
        "columns": ["what", "status", "result", "wall_s", "tokens_per_s", "leaked_gib", "note", "error"],
        "problems": problems,
    }


# --------------------------------------------------------------------------- 8. training steps
def training(check: Check) -> dict[str, Any]:
    from snapkv_rag.adapter_training.train import TuneConfig, tune

    s = check.sizes
    rows: list[dict[str, Any]] = []
    shapes = [("1b", "Llama-3.2-1B shape" if not check.tiny else "tiny llama (1B stand-in)"), ("8b", None)]
    for shape, label in shapes:
        row: dict[str, Any] = {"model": label or "", "steps": s.train_steps}
        rows.append(row)
        if not check.fits(5):
            row["status"] = "skipped: time limit"
            continue
        model = None
        try:
            if shape == "8b":
                big = check.big()
                model, row["model"] = big.model, big.label
                big.spent = True  # tune adds LoRA layers to it: no later part may use it
            else:
                model = build_model(check, shape, seed=1)
            config = TuneConfig(
                examples=s.train_steps * s.train_accumulate,
                accumulate=s.train_accumulate,
                eval_examples=0,
                warmup_steps=0,
                save_every=10**6,
                max_tokens=s.train_max_tokens,
            )
            steps: list[dict] = []
            note = ""
            with tempfile.TemporaryDirectory() as out, Peak(check) as peak:
                start = time.perf_counter()
                try:
                    tune(config, out, model=model, tokenizer=check.tokenizer, progress=False, on_step=steps.append)
                except ModuleNotFoundError as exc:  # plot_loss's matplotlib, after the steps ran
                    if not steps or exc.name != "matplotlib":
                        raise
                    note = "tune() ended at its loss plot (no matplotlib here); the steps had run"
                check.sync()
                seconds = time.perf_counter() - start
            tokens = sum(r["tokens"] for r in steps)
            peak_bytes = int(torch.cuda.max_memory_allocated(check.device)) if check.cuda else rss_bytes()
            row.update(
                status="ok",
                steps=len(steps),
                tokens=tokens,
                tokens_per_s=tokens / seconds if seconds else None,
                step_tokens_per_s=[r["tokens_per_s"] for r in steps],
                loss=[round(r["loss"], 3) for r in steps],
                seconds=seconds,
                peak_over_start_gib=(peak_bytes - peak.before) / GIB,
                peak_kind="cuda allocator" if check.cuda else "process RSS at the end",
                note=note or "tokens/s over the whole call (its checkpoint and adapter writes included)",
            )
        except Exception as exc:
            row.update(status="error", error=first_line(exc))
            check.log(f"training {shape}: {traceback.format_exc()}")
        finally:
            del model
            check.clean()
    columns = ["model", "status", "steps", "tokens", "tokens_per_s", "step_tokens_per_s", "loss", "peak_over_start_gib", "peak_kind", "note", "error"]
    checkpointing = "tune's default (on for CUDA)" if "gradient_checkpointing" in TuneConfig.__dataclass_fields__ else "not offered by this tune"
    summary = {"accumulate": s.train_accumulate, "max_tokens": s.train_max_tokens, "gradient_checkpointing": checkpointing}
    return {"summary": summary, "rows": rows, "columns": columns}


PARTS: list[tuple[str, Callable[[Check], dict[str, Any]]]] = [
    ("preflight", preflight),
    ("device_vs_cpu", device_vs_cpu),
    ("decode_speed", decode_speed),
    ("compiled_decode", compiled_decode),
    ("prefill_memory", prefill_memory),
    ("rolling_prefill", rolling_prefill),
    ("kv_reuse_drafts", kv_reuse_drafts),
    ("concurrency_oom", concurrency_oom),
    ("training", training),
]
PART_NAMES = [name for name, _ in PARTS]
BIG_PARTS = set(PART_NAMES[2:])  # the 8B shape's parts: a GPU's (or --tiny's)


# --------------------------------------------------------------------------- records and the table
def header(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """What every record carries: the device, the versions, the date and the command."""
    try:
        import transformers

        transformers_version = transformers.__version__
    except Exception as exc:  # the preflight records the details
        transformers_version = f"import failed: {first_line(exc)}"
    try:
        from snapkv_rag import __version__
    except Exception:
        __version__ = "?"
    cuda = args.device == "cuda" and torch.cuda.is_available()
    return {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine() or "cpu"),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "snapkv_rag": __version__,
        "mode": "tiny" if args.tiny else "full",
        "time_limit_s": args.time_limit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m eval gpu_check " + shlex.join(argv),
    }


def row_label(row: dict[str, Any]) -> str:
    """A row named by its first few values (for a part's error message)."""
    return " ".join(str(v) for k, v in list(row.items())[:3] if k not in ("status", "error"))


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(cell(v) for v in value) + "]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def status_text(record: dict[str, Any]) -> str:
    if record["status"] == "failed":
        return f"failed: {record.get('error_type')}"
    if record.get("reason"):
        return f"{record['status']}: {record['reason']}"
    return record["status"]


def table_lines(records: list[dict[str, Any]]) -> list[str]:
    head = records[0]
    lines = [
        f"# GPU check: {head['device_name']} ({head['device']}), {head['mode']} mode",
        "",
        f"{head['date']}; torch {head['torch']}, transformers {head['transformers']}, Python {head['python']}, snapkv-rag {head['snapkv_rag']}; "
        f"time limit {head['time_limit_s']} s.",
        "",
        f"`{head['command']}`",
        "",
        "| # | part | status | seconds | summary |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        summary = r.get("summary") or {}
        text = "; ".join(f"{k} {cell(v)}" for k, v in summary.items())
        if r["status"] == "failed":
            text = cell(r.get("error", ""))[:300]
        lines.append(f"| {r['part']} | {r['name']} | {status_text(r)} | {cell(r.get('seconds'))} | {cell(text)} |")
    for r in records:
        rows = r.get("rows") or []
        if not rows:
            continue
        columns = [c for c in r.get("columns") or list(rows[0]) if any(row.get(c) is not None for row in rows)]
        lines += ["", f"## {r['part']}. {r['name']}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eval gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check", help="folder for records.jsonl, table.md and gpu_check.log")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is one, else cpu")
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds for all parts; a part that does not fit is skipped (default 480)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU in well under a minute; what CI runs)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.time_limit <= 0:
        print("gpu_check: --time-limit must be > 0 seconds", file=sys.stderr)
        return 2
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    check = Check(args)
    head = header(args, argv)
    check.log(f"{head['command']} on {head['device_name']}: {head['mode']} mode, {args.time_limit} s")
    records: list[dict[str, Any]] = []
    for number, (name, part) in enumerate(PARTS, 1):
        record: dict[str, Any] = {"part": number, "name": name, **head}
        estimate = check.sizes.estimates.get(name, 0.0)
        start = time.monotonic()
        if name != "preflight" and args.device == "cuda" and not torch.cuda.is_available():
            record.update(status="skipped", reason="no CUDA device (see the preflight)")
        elif name in BIG_PARTS and not args.tiny and args.device == "cpu":
            record.update(status="skipped", reason="full shapes need a GPU (--tiny runs them small on a CPU)")
        elif not check.fits(estimate):
            record.update(status="skipped", reason="time limit")
        else:
            check.log(f"part {number} {name}: {check.left():.0f} s left")
            try:
                result = part(check)
                problems = result.pop("problems", None) or []
                problems += [f"{row_label(row)}: {row['error']}" for row in result.get("rows", []) if row.get("status") == "error" and row.get("error")]
                record.update(result)
                if problems:
                    record.update(status="failed", error_type="CheckFailed", error="; ".join(problems)[:2000])
                    check.log(f"part {number} {name} failed its checks: {record['error']}")
                else:
                    record["status"] = "ok"
            except Skip as exc:
                record.update(status="skipped", reason=str(exc))
            except Exception as exc:
                record.update(status="failed", error_type=type(exc).__name__, error=str(exc)[:2000])
                check.log(f"part {number} {name} failed: {traceback.format_exc()}")
            finally:
                check.clean()
        record["seconds"] = round(time.monotonic() - start, 2)
        check.log(f"part {number} {name}: {status_text(record)} ({record['seconds']} s)")
        records.append(record)
        write_records(check.out, records)  # after every part: a run killed later keeps what it measured
    write_table(check.out, table_lines(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

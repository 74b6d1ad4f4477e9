"""A compiled decode step over a static cache, for the batches the scheduler decodes together.

A decode step in eager mode is some 1,500 small operator calls dispatched one by one from Python
(about 30 layers of transformers modules); llama.cpp runs one C++ graph. Here the model's own
forward for one token per row (or a lone request's token and its prompt-lookup draft) is compiled once with ``torch.compile`` (Inductor: C++/OpenMP
kernels on the CPU, CUDA graphs on a GPU) over a cache whose shape does not change from step to
step: every layer's keys and values sit in buffers of a fixed capacity (:class:`StaticBatch`), the
new token's entry is written in place at the next free column, and a boolean mask says which
columns hold entries. A compressed cache suits this: after the prefill each layer's size is
known, so the buffers are the kept entries plus room for the tokens still to come.

Shapes: the rows, the tokens per row and the capacity are dynamic dimensions (a batch of one and
one token are graphs of their own: ``torch.compile`` specialises size 1), so a mixed workload
compiles two or three graphs; :data:`MAX_GRAPHS` bounds them and the step runs eager past it. Compiled artifacts are
cached on disk (``TORCHINDUCTOR_CACHE_DIR``, by default under the toolkit's cache directory), so a
second process skips Inductor's code generation. Where compiling cannot work (no C++ compiler,
several devices, the portable mode) or fails, the step runs eager and the reason is said once in
the log, in :meth:`CompiledDecode.stats` and in each request's ``stats.decode_step``.

The compiled forward is the same model, the same weights and the same attention function
(:func:`~snapkv_rag.compression.runtime.decode_attention`) as the eager step: nothing is
re-implemented, so the tokens are the eager step's (fp32: identical greedy tokens in the tests).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
import types
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..compression.decoding import layer_entries
from ..model.loading import cache_root
from ..model.portable import portable_enabled

log = logging.getLogger(__name__)

ENVIRONMENT = "SNAPKV_RAG_COMPILE_DECODE"
MAX_GRAPHS = 6  # compiled graphs per engine (batch of one, batches, and a few re-specialisations)
HEADROOM = 64  # columns allocated beyond the cache's entries for the tokens to come (moved to larger buffers as it fills)
COLUMN_ALIGN = 64
_ENGINES = itertools.count()


def compile_from_environment() -> bool:
    return os.environ.get(ENVIRONMENT, "0") == "1"


def inductor_cache_dir() -> str:
    """Where Inductor keeps compiled kernels: ``TORCHINDUCTOR_CACHE_DIR`` where a user set it, else
    under the toolkit's cache directory (Inductor's own default is under /tmp, which a reboot clears)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return chosen if chosen and chosen != default_cache_dir() else str(cache_root() / "inductor")


def unavailable_reason(model) -> str | None:
    """Why this model's decode step cannot be compiled here (None: it can)."""
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return "the model is placed on several devices"
    (device,) = devices
    if device.type not in ("cpu", "cuda"):
        return f"no compiled step on {device.type}"
    if portable_enabled():
        return "the portable mode runs eager"
    if device.type == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        return "no C++ compiler (install g++; scripts/setup.sh does)"
    text = model.config.get_text_config(decoder=True)
    # the compiled step gives the model its own mask over the buffers, which knows no window or softcap
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        return "the model's sliding window is not compiled"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "the model's attention softcap is not compiled"
    return None


class StaticKV(Cache):
    """The cache a compiled step reads: per layer, keys and values ``[rows, kv_heads, capacity, d]``;
    a forward of ``t`` tokens per row writes their entries from column ``write_at`` of every layer."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], write_at: torch.Tensor):
        self.keys, self.values, self.write_at = keys, values, write_at
        self.layers = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        columns = self.write_at + torch.arange(key_states.shape[2], device=keys.device)
        keys.index_copy_(2, columns, key_states)
        values.index_copy_(2, columns, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given


def _columns(entries: int) -> int:
    return -(-entries // COLUMN_ALIGN) * COLUMN_ALIGN


class StaticBatch:
    """A batch's cache (a plain, unpadded-per-layer DynamicCache and its 2-D mask) moved into
    fixed-capacity buffers; :meth:`unload` gives it back as views, entries in the same order."""

    def __init__(self, cache, mask: torch.Tensor | None, headroom: int):
        first = cache.layers[0].keys
        rows, width = first.shape[0], layer_entries(cache.layers[0])
        self.rows, self.width = rows, width
        self.capacity = _columns(width + max(1, headroom))
        keys, values = [], []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            buffer_k = k.new_zeros(rows, k.shape[1], self.capacity, k.shape[3])
            buffer_v = v.new_zeros(rows, v.shape[1], self.capacity, v.shape[3])
            buffer_k[:, :, :width] = k
            buffer_v[:, :, :width] = v
            keys.append(buffer_k)
            values.append(buffer_v)
        self.valid = torch.zeros(rows, self.capacity, dtype=torch.bool, device=first.device)
        self.valid[:, :width] = True if mask is None else mask.bool()
        self.kv = StaticKV(keys, values, torch.zeros((), dtype=torch.long, device=first.device))
        for tensor in (*keys, *values):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 2)
            if tensor.device.type == "cuda":  # CUDA graphs read the buffers in place instead of copying them in every replay
                torch._dynamo.mark_static_address(tensor)
        torch._dynamo.maybe_mark_dynamic(self.valid, 0)
        torch._dynamo.maybe_mark_dynamic(self.valid, 1)

    def fits(self, tokens: int) -> bool:
        return self.width + tokens <= self.capacity

    def drop(self, count: int) -> None:
        """Forget the last ``count`` entries (rejected draft tokens): their columns are free again."""
        self.width -= count
        self.valid[:, self.width : self.width + count] = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.kv.keys, *self.kv.values))

    def unload(self, cache) -> torch.Tensor | None:
        """Put the entries back into ``cache``'s layers (views of the buffers); the 2-D mask, or
        None where every entry is real."""
        for layer, keys, values in zip(cache.layers, self.kv.keys, self.kv.values):
            layer.keys = keys[:, :, : self.width]
            layer.values = values[:, :, : self.width]
        mask = self.valid[:, : self.width]
        return None if bool(mask.all()) else mask.long()


def _decode_forward(model, kv: StaticKV, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Logits ``[rows, t, vocab]`` of ``tokens [rows, t]``: each sees the valid entries and the new
    tokens up to itself."""
    columns = torch.arange(valid.shape[1], device=valid.device)
    last = kv.write_at + torch.arange(tokens.shape[1], device=valid.device)
    mask = valid[:, None, :] & (columns[None, None, :] <= last[None, :, None])  # [rows, t, capacity]
    return model(input_ids=tokens, position_ids=positions, attention_mask=mask[:, None], cache=kv, use_cache=True, logits_to_keep=0).logits


class CompiledDecode:
    """The engine's compiled decode step (one per model); :meth:`step` decodes a :class:`StaticBatch`."""

    def __init__(self, model, enabled: bool):
        self.model = model
        self.enabled = enabled
        self.why_not: str | None = None if not enabled else unavailable_reason(model)
        self.graphs = 0
        self.compile_seconds = 0.0
        self.steps = 0
        self.loads = 0  # batches moved into static buffers (a new batch, rows joining or leaving, growth)
        self.transient: str | None = None  # why the latest step ran eager though compiling works
        self.first_step_seconds: float | None = None  # the first compiled call, tracing and compiling included
        self._fn: Any = None
        if self.usable:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()

    @property
    def usable(self) -> bool:
        return self.enabled and self.why_not is None

    def refusal(self) -> str | None:
        """Why a step runs eager (None: it runs compiled)."""
        if not self.enabled:
            return "compile_decode is off"
        return self.why_not

    def _backend(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        # on a GPU the step is replayed as a CUDA graph (one launch instead of hundreds); not yet
        # measured on a GPU in this repository (eval/gpu_check's compiled_decode part measures it)
        cuda = next(self.model.parameters()).device.type == "cuda"
        compiled = compile_fx(graph, example_inputs, config_patches={"triton.cudagraphs": True} if cuda else None)
        self.graphs += 1
        self.compile_seconds += time.perf_counter() - start
        return compiled

    def _compiled(self):
        if self._fn is None:
            # Dynamo keeps compiled graphs, and its recompile limit, per code object: a code object of
            # this engine's own keeps another engine's graphs (another model in the process) apart
            code = _decode_forward.__code__.replace(co_name=f"_decode_forward_{next(_ENGINES)}")
            forward = types.FunctionType(code, _decode_forward.__globals__, code.co_name)
            self._fn = torch.compile(forward, fullgraph=True, dynamic=None, backend=self._backend)
        return self._fn

    def load(self, cache, mask: torch.Tensor | None, headroom: int) -> StaticBatch | None:
        """The batch's entries in static buffers (a copy: twice the cache at that moment); None when
        they do not fit in memory (the batch then decodes eager)."""
        try:
            batch = StaticBatch(cache, mask, headroom)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            self.transient = f"no memory for the static buffers ({type(exc).__name__})"
            return None
        self.loads += 1
        return batch

    def step(self, batch: StaticBatch, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The logits ``[rows, t, vocab]`` after appending ``tokens [rows, t]`` (one token per row, or a
        token and its draft) at ``positions [rows, t]``; None when the step cannot run compiled (the
        batch is then as it was; :attr:`why_not` says why)."""
        if not self.usable:
            return None
        t = tokens.shape[1]
        assert batch.fits(t) and tokens.shape[0] == batch.rows
        column = batch.width
        batch.valid[:, column : column + t] = True
        batch.kv.write_at.fill_(column)
        for tensor in (tokens, positions):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        start = time.perf_counter()
        try:
            logits = self._compiled()(self.model, batch.kv, tokens, positions, batch.valid)
        except (torch.OutOfMemoryError, MemoryError) as exc:  # this step only: the batch goes on eager
            batch.valid[:, column : column + t] = False
            self.transient = f"out of memory in the compiled step ({type(exc).__name__})"
            return None
        except Exception as exc:  # a feature Dynamo or Inductor cannot handle: eager from now on
            batch.valid[:, column : column + t] = False
            self.why_not = f"compiling failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            log.warning("compiled decode off: %s", self.why_not)
            return None
        if self.first_step_seconds is None:
            self.first_step_seconds = time.perf_counter() - start
        if self.graphs > MAX_GRAPHS:
            self.why_not = f"{self.graphs} graphs compiled: past the bound on recompiles ({MAX_GRAPHS})"
            log.warning("compiled decode off: %s", self.why_not)
        batch.width += t
        self.steps += 1
        # a CUDA graph's output lives in memory its next replay reuses, and callers hold the logits
        return logits.clone() if logits.device.type == "cuda" else logits

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "why_not": self.why_not,
            "graphs": self.graphs,
            "compile_seconds": round(self.compile_seconds, 2),
            "first_step_seconds": None if self.first_step_seconds is None else round(self.first_step_seconds, 2),
            "steps": self.steps,
            "loads": self.loads,
            "cache_dir": inductor_cache_dir() if self.enabled else None,
        }

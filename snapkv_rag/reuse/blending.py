"""Blended prefill: reuse stored segment K/V at new positions, recompute only what changed most.

How a prompt's segments map to tokens (:func:`segment_token_spans`): each segment text is
found in the rendered prompt (in any order; a repeated text is matched once per occurrence),
and its span is the tokens lying wholly inside it. A token that straddles a segment boundary (a tokenizer that merges
across it, a chat template that glues text to it) belongs to no span and is computed fresh,
so a boundary can shrink a span but never corrupt one. A segment not found is computed fresh.

Moving K/V (:class:`RopeShift`): a segment is computed once after a fixed anchor (the
prompt's first token: BOS or the template's opening token, so the segment's own first
token does not turn into an attention sink), at positions ``a..a+m-1``; a RoPE rotation is
additive in the position, so rotating every stored key by ``p - a`` gives the key at the
segment's new start ``p``. The rotation comes from the model's own rotary module
(its inverse frequencies, scaling and partial rotary dims), never from per-family code, and
is checked once per model: layer-0 keys (which depend only on the token and its position)
computed at an offset must equal the shifted ones. A model without RoPE, with
position-dependent scaling (dynamic NTK, LongRoPE) is refused, and so, for segments, is one with
sliding-window layers (a cache that keeps only a window); their prompts are prefilled whole. A
model whose layer types have their own rotary frequencies (Gemma 3's local and global layers)
moves each layer's keys with its own.

Which reused tokens are recomputed (:func:`recompute_positions`), as CacheBlend does: run the
first layers over the whole prompt, measure on the probe layer how far each reused token's
K/V lies from the fresh one (the cross-attention a chunk missed while computed alone), and
recompute the ``recompute`` share that deviate most, through every layer. Everything not
covered by a stored segment, and the policy's observation window, is always computed.
The blended forward runs only those tokens, attending to the whole prompt's cache in
position order (:class:`BlendingCache` writes their K/V into their slots), so the
compression policy then selects exactly as after a full prefill. With ``recompute=1.0``
every token is computed and the result equals a full prefill.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..compression.rotary import rotate
from ..compression.runtime import LayersDone, exiting_after_layer
from .segment_store import SegmentKV, SegmentKVStore

#: Share of reused tokens recomputed by default (CacheBlend's 15%; see eval/reuse/RESULTS.md, "Chunk-level K/V reuse", for the curve).
DEFAULT_RECOMPUTE = 0.15
_OFFSET_CHECK = 37
_ANGLE_CACHE = 4096  # offsets whose rotary angles are kept (a few KB each)
_REFUSED_ROPE_TYPES = ("dynamic", "longrope")


class SegmentReuseUnsupported(Exception):
    """This model cannot move stored K/V to new positions; the reason is the message."""


def segment_token_spans(offsets: Sequence[tuple[int, int]], text: str, segments: Sequence[str], shift: int = 0) -> list[tuple[int, int]]:
    """Token spans ``[start, end)``, in prompt order, of ``segments`` found in ``text`` (each at its
    first occurrence that overlaps no other segment's), whose tokens have character ``offsets``;
    ``shift`` is added to every index (tokens added or removed at the front after tokenizing,
    such as a BOS). Segments not found or covering no whole token are left out."""
    import bisect

    starts = [start for start, _ in offsets]
    taken: list[tuple[int, int]] = []  # character ranges already placed
    spans: list[tuple[int, int]] = []
    for segment in segments:
        if not segment:
            continue
        at = text.find(segment)
        while at >= 0 and any(at < end and at + len(segment) > begin for begin, end in taken):
            at = text.find(segment, at + 1)
        if at < 0:
            continue
        end_char = at + len(segment)
        taken.append((at, end_char))
        first = bisect.bisect_left(starts, at)
        last = first
        while last < len(offsets) and offsets[last][0] < end_char and offsets[last][1] <= end_char:
            last += 1
        inside = [i for i in range(first, last) if offsets[i][1] > offsets[i][0]]
        if inside:
            spans.append((inside[0] + shift, inside[-1] + 1 + shift))
    return sorted(spans)


def _decoder(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return getattr(decoder, "language_model", decoder)


class RopeShift:
    """Rotate stored keys by a position offset with the model's own rotary embedding."""

    def __init__(self, model) -> None:
        decoder = _decoder(model)
        rotary = getattr(decoder, "rotary_emb", None)
        config = model.config.get_text_config(decoder=True)
        # Gemma 3 has one rotary module with inverse frequencies per layer type (local and global)
        self.layer_types: list[str] | None = list(config.layer_types) if rotary is not None and _takes_layer_type(rotary) else None
        kinds = sorted(set(self.layer_types)) if self.layer_types else [None]
        if rotary is None or not all(hasattr(rotary, f"{kind}_inv_freq" if kind else "inv_freq") for kind in kinds):
            raise SegmentReuseUnsupported("the model has no rotary position embedding to move stored keys with")
        rope_types = getattr(rotary, "rope_type", "default")
        if any(t in _REFUSED_ROPE_TYPES for t in (rope_types.values() if isinstance(rope_types, dict) else [rope_types])):
            raise SegmentReuseUnsupported(f"rope type {rope_types!r} depends on the sequence length")
        self.rotary = rotary
        self.scaling = {kind: float(getattr(rotary, f"{kind}_attention_scaling" if kind else "attention_scaling", 1.0) or 1.0) for kind in kinds}
        self.dtype = model.dtype
        self.device = next(model.parameters()).device
        self._offset_angles: dict[tuple[int, str | None, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._check(model)

    def kind(self, layer_idx: int) -> str | None:
        """Layer ``layer_idx``'s rotary kind (None: one rotary for every layer)."""
        return self.layer_types[layer_idx] if self.layer_types else None

    def __call__(self, keys: torch.Tensor, offset: int, layer_idx: int = 0) -> torch.Tensor:
        """Layer ``layer_idx``'s ``keys [..., m, head_dim]`` moved ``offset`` positions later (earlier when negative)."""
        if offset == 0:
            return keys
        kind = self.kind(layer_idx)
        cached = self._offset_angles.get((offset, kind, keys.device))
        if cached is None:  # one rotary call per offset, not per layer and segment (every layer of a kind shares it)
            cos, sin = self._angles(torch.tensor([offset], device=keys.device), kind)
            cached = cos[0], sin[0]
            if len(self._offset_angles) >= _ANGLE_CACHE:
                self._offset_angles.clear()
            self._offset_angles[(offset, kind, keys.device)] = cached
        return self._rotate(keys, *cached)

    def each(self, keys: torch.Tensor, offsets: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """Layer ``layer_idx``'s ``keys [..., m, head_dim]``, each entry moved by its own offset (``offsets``: ``keys.shape[:-1]``)."""
        cos, sin = self._angles(offsets.reshape(-1).to(keys.device), self.kind(layer_idx))
        return self._rotate(keys, cos.reshape(*offsets.shape, -1), sin.reshape(*offsets.shape, -1))

    def _angles(self, offsets: torch.Tensor, kind: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[len(offsets), rotary_dim]`` of the model's rotary embedding (of layer type ``kind``) at ``offsets``."""
        probe = torch.zeros(1, 1, 1, dtype=torch.float32, device=offsets.device)
        cos, sin = self.rotary(probe, offsets[None], kind) if kind else self.rotary(probe, position_ids=offsets[None])
        return cos[0] / self.scaling[kind], sin[0] / self.scaling[kind]

    def angles(self, offsets: torch.Tensor, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[len(offsets), rotary_dim]`` of layer ``layer_idx``'s rotary embedding at ``offsets``
        (what :func:`~snapkv_rag.compression.rotary.rotary_angles` hands a policy)."""
        return self._angles(offsets.reshape(-1), self.kind(layer_idx))

    @staticmethod
    def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(keys, cos, sin)

    @torch.inference_mode()
    def _check(self, model) -> None:
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.arange(3, 3 + 8, device=self.device).remainder(vocab)[None]
        at_zero = layer_kv(model, ids, torch.arange(8, device=self.device)[None], layers=1)[0][0]
        at_offset = layer_kv(model, ids, torch.arange(_OFFSET_CHECK, _OFFSET_CHECK + 8, device=self.device)[None], layers=1)[0][0]
        moved = self(at_zero, _OFFSET_CHECK, layer_idx=0).float()
        tolerance = (1e-3 if self.dtype == torch.float32 else 3e-2) * float(at_offset.float().abs().max()) + 1e-5
        if float((moved - at_offset.float()).abs().max()) > tolerance:
            raise SegmentReuseUnsupported("shifted layer-0 keys differ from keys computed at the offset (not a rotate-half RoPE)")


_SHIFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SHIFTS_LOCK = threading.Lock()


def model_rope_shift(model, run: Callable[[Callable[[], RopeShift]], RopeShift] | None = None, *, sliding: bool = False) -> RopeShift:
    """The model's :class:`RopeShift`, built (and checked) once; raises :class:`SegmentReuseUnsupported`.

    ``run``: where the check's forward runs the first time (the engine's model worker); default here.
    ``sliding``: also for a model with sliding-window layers (a rolling prefill moves their window
    along; stored segments and prefixes cannot be placed in a cache that keeps only a window)."""
    from ..compression.runtime import sliding_layers

    if not sliding and any(sliding_layers(model.config)):
        raise SegmentReuseUnsupported("sliding-window layers keep only a window of the prompt")
    with _SHIFTS_LOCK:
        shift = _SHIFTS.get(model)
    if shift is None:
        try:
            shift = run(lambda: RopeShift(model)) if run is not None else RopeShift(model)
        except SegmentReuseUnsupported as exc:
            shift = exc
        with _SHIFTS_LOCK:
            _SHIFTS[model] = shift
    if isinstance(shift, SegmentReuseUnsupported):
        raise shift
    return shift


def _takes_layer_type(rotary) -> bool:
    import inspect

    return "layer_type" in inspect.signature(rotary.forward).parameters


def layer_kv(model, ids: torch.Tensor, positions: torch.Tensor, *, layers: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V ``[1, kv_heads, n, head_dim]`` of ``ids`` at ``positions`` with a plain
    causal forward; ``layers``: stop after that many decoder layers (a cheap probe)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # the probe's own exit; None (every layer) also lifts the exit of a read this runs inside, so a
    # segment stored for every later read is computed whole
    last = layers - 1 if layers is not None and layers < len(_decoder(model).layers) else None
    try:
        with exiting_after_layer(last, model):
            model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    except LayersDone:
        pass
    count = layers if layers is not None else len(cache.layers)
    layers_kv: list = list(cache.layers[:count])  # DynamicLayer: keys and values set by the forward
    return [layer.keys for layer in layers_kv], [layer.values for layer in layers_kv]


@torch.inference_mode()
def compute_segment(model, token_ids: list[int], anchor: Sequence[int] = ()) -> SegmentKV:
    """A segment's K/V (every layer, uncompressed) computed after ``anchor`` alone: at
    positions ``len(anchor)..``; the anchor's own K/V are dropped."""
    device = next(model.parameters()).device
    ids = torch.tensor([[*anchor, *token_ids]], device=device)
    keys, values = layer_kv(model, ids, torch.arange(ids.shape[1], device=device)[None])
    skip = len(anchor)
    return SegmentKV(list(token_ids), host_copy(torch.cat(keys)[:, :, skip:]), host_copy(torch.cat(values)[:, :, skip:]), list(anchor))


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in CPU memory, page-locked where a GPU will read it back (its copies to the device
    then run asynchronously, without a staging copy through pageable memory)."""
    host = tensor.cpu()
    return host.pin_memory() if torch.cuda.is_available() else host


@dataclass
class SegmentRequest:
    """What one prompt asks of segment reuse: its token spans, where entries live, how much to recompute."""

    spans: list[tuple[int, int]]
    anchor: list[int]  # the tokens each segment is computed after (the prompt's first token)
    store: SegmentKVStore
    signature: str
    recompute: float
    shift: RopeShift


@dataclass
class AssembledPrompt:
    """Where each stored segment goes in the prompt; a layer's K/V are assembled only when that
    layer runs (:meth:`layer`), so no more than one layer's uncompressed K/V exists at once."""

    n: int
    placed: list[tuple[int, SegmentKV]]  # (start position, entry)
    covered: torch.Tensor  # [n] bool: K/V come from a stored segment
    hits: int
    misses: int
    shift: RopeShift
    anchor_length: int
    shape: tuple[int, int]  # (kv_heads, head_dim)
    dtype: torch.dtype
    device: torch.device
    exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layers the probe computed whole

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, kv_heads, n, head_dim]`` K and V of one layer: stored segments moved into place, zeros elsewhere."""
        if index in self.exact:
            return self.exact.pop(index)
        kv_heads, head_dim = self.shape
        keys = torch.zeros(1, kv_heads, self.n, head_dim, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        for start, entry in self.placed:
            end = start + len(entry.token_ids)
            keys[0, :, start:end] = self.shift(entry.keys[index].to(self.device, non_blocking=True), start - self.anchor_length)
            values[0, :, start:end] = entry.values[index].to(self.device, non_blocking=True)
        return keys, values


def segment_anchor(row: list[int]) -> list[int]:
    """The tokens every segment of this prompt is computed after: its first token (BOS or the template's opening)."""
    return row[:1]


def kv_shape(model) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of the model's cache: the shape a stored entry must have."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def stored_or_computed(model, store: SegmentKVStore, signature: str, tokens: list[int], anchor: list[int]) -> tuple[SegmentKV, bool]:
    """The segment's entry from ``store``, or computed now and stored; and whether it was stored already."""
    entry = store.get(signature, model.dtype, tokens, kv_shape(model), anchor)
    if entry is not None:
        return entry, True
    entry = compute_segment(model, tokens, anchor)
    store.put(signature, model.dtype, entry)
    return entry, False


def assemble(model, row: list[int], request: SegmentRequest) -> AssembledPrompt:
    """Load (or compute and store) every span's segment and note where it goes."""
    covered = torch.zeros(len(row), dtype=torch.bool)
    placed: list[tuple[int, SegmentKV]] = []
    hits = 0
    for start, end in request.spans:
        entry, hit = stored_or_computed(model, request.store, request.signature, row[start:end], request.anchor)
        hits += hit
        placed.append((start, entry))
        covered[start:end] = True
    device = next(model.parameters()).device
    misses = len(request.spans) - hits
    return AssembledPrompt(len(row), placed, covered, hits, misses, request.shift, len(request.anchor), kv_shape(model)[1:], model.dtype, device)


def recompute_positions(model, row: list[int], prompt: AssembledPrompt, tail: int, ratio: float, probe_layer: int = 1) -> torch.Tensor:
    """Sorted positions to run through the model: everything not covered, the last ``tail``
    tokens, and the ``ratio`` share of covered tokens whose K/V deviate most on ``probe_layer``.

    The probe's fresh K/V of layers ``0..probe_layer`` replace the assembled ones for every
    token (they were computed anyway, and they are exact)."""
    n = len(row)
    fresh = ~prompt.covered
    fresh[max(0, n - tail) :] = True
    reused = (~fresh).nonzero().flatten()
    count = round(ratio * reused.numel())
    if count >= reused.numel():
        return torch.arange(n)
    if count > 0:
        device = prompt.device
        probe_layer = min(probe_layer, len(_decoder(model).layers) - 1)
        ids = torch.tensor([row], device=device)
        keys, values = layer_kv(model, ids, torch.arange(n, device=device)[None], layers=probe_layer + 1)
        stored_keys, stored_values = prompt.layer(probe_layer)
        deviation = (keys[probe_layer] - stored_keys).float().pow(2).sum(dim=(0, 1, 3))
        deviation += (values[probe_layer] - stored_values).float().pow(2).sum(dim=(0, 1, 3))
        score = deviation.cpu()
        chosen = reused[score[reused].topk(count).indices]
        fresh[chosen] = True
        prompt.exact.update({layer: (keys[layer], values[layer]) for layer in range(probe_layer + 1)})
    return fresh.nonzero().flatten()


def blending_cache(model, prompt: AssembledPrompt, positions: torch.Tensor):
    """A cache whose first update of each layer takes that layer's assembled K/V and writes the
    computed tokens' K/V into their slots (``positions``) instead of appending them."""
    from transformers import DynamicCache

    class BlendingCache(DynamicCache):
        scatter: torch.Tensor | None = None

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.scatter is None:
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            keys, values = prompt.layer(layer_idx)
            keys.index_copy_(2, self.scatter, key_states)
            values.index_copy_(2, self.scatter, value_states)
            layer = self.layers[layer_idx]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            return keys, values

    cache = BlendingCache(config=model.config)
    cache.scatter = positions.to(prompt.device)
    return cache


def blended_mask(positions: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, len(positions), n]`` bool: each computed token attends to every position up to its own."""
    positions = positions.to(device)
    return (torch.arange(n, device=device)[None, :] <= positions[:, None])[None, None]

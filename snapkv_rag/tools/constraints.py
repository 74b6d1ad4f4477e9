"""Grammar-constrained decoding with llguidance: one token mask per row and step.

An :class:`OutputSpec` becomes a Lark grammar (JSON Schemas embedded with ``%json``) that
an ``llguidance.LLMatcher`` runs per row. :class:`BatchConstraint` is the one object the
decode loop consults: ``mask(logits)`` before a token is chosen, ``advance(tokens)`` after.
Rows without a spec (and rows whose grammar has finished) are left untouched, so rows with
and without constraints share a batch, and the cache (compressed or not) never notices.

Near the end of ``max_new_tokens`` a constrained row that is still inside its JSON is steered
to close it (see :class:`JsonDepth`): a small model can loop inside a string value until the
token budget runs out, and a truncated call or answer is useless, while a closed one with a
short last value still parses and validates.

Why llguidance and not xgrammar (both measured on CPU, see eval/agents/RESULTS.md, "Tool calling and structured output"): its per-step
mask costs well under 1 ms on SmolLM2's 49K vocabulary (about 1% of a decode step), it is a
single dependency-free wheel (xgrammar's wheel requires triton, about 1 GB, on Linux), and its
Lark grammars with inline ``%json`` express "free text, or a call once the marker starts"
directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import StructuredOutputError
from .calls import CALL_CLOSE, CALL_OPEN, MARKER, OutputSpec, call_prefix

# Compact JSON with json.dumps' default separators: no free whitespace a model could loop on.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # JSON string escapes are valid Lark string escapes


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where objects that list ``properties`` allow no others unless they say so.

    Used for the grammar only (as OpenAI's strict mode does): a small model otherwise copies
    stray keys such as ``"type": "integer"`` from the tool listing into its arguments.
    Validation still uses the schema as given.
    """
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}  # maps of name -> schema
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value  # data, not schemas
        else:
            out[key] = closed_objects(value)
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _json_rule(schema: dict[str, Any]) -> str:
    options = {**(schema.get("x-guidance") or {}), **JSON_OPTIONS}
    return "%json " + json.dumps({**closed_objects(schema), "x-guidance": options}, ensure_ascii=False)


def grammar_for(spec: OutputSpec) -> str | None:
    """The Lark grammar of one row, or None when the row is free text."""
    if not spec.constrained:
        return None
    lines = ["%llguidance {}"]
    if spec.calls_tools:
        tools = spec.callable_tools
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        for i, tool in enumerate(tools):
            lines.append(f'call_{i}: {_lark_string(call_prefix(tool.name))} args_{i} "}}"')
            lines.append(f"args_{i}: {_json_rule(tool.parameters)}")
        lines.append(f"block: {_lark_string(CALL_OPEN)} call {_lark_string(CALL_CLOSE)}")
        # Up to call_limit blocks, then the grammar ends (EOS only): ("\n" block ("\n" block)?)? ...
        more = ""
        for _ in range(spec.call_limit - 1):
            more = f' ("\\n" block{more})?'

        if spec.tool_choice in ("required", "function"):
            lines.append(f"start: block{more}")
        elif spec.json_schema is not None:
            # "auto" with a response format: the JSON content, or calls from the first token
            # (prose before a call would be neither, and could never end validly).
            lines.append(f"start: json_out | block{more}")
            lines.append(f"json_out: {_json_rule(spec.json_schema)}")
        else:
            # "auto": text that never contains the marker, or text up to the marker and then a
            # constrained call (the lazy prefix ends at the first marker).
            lines.append(f"start: TEXT | prefix call {_lark_string(CALL_CLOSE)}{more}")
            lines.append(f"prefix[lazy]: /(.|\\n)*{MARKER}\\n/")
            lines.append(f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{MARKER}(.|\\n)*/")
    else:
        lines.append(f"start: {_json_rule(spec.json_schema or {})}")
    return "\n".join(lines) + "\n"


def closing_reserve(max_new_tokens: int) -> int:
    """The last steps of a constrained row in which an unfinished JSON value is steered to close."""
    return max(8, min(64, max_new_tokens // 4))


_STRUCTURAL = frozenset('"{}[]\\')


class JsonDepth:
    """How far an output is from closing its JSON: open containers plus an open string.

    Tracked per token from the last point where the grammar accepted (so free text before a
    tool call does not count). Only the characters ``"{}[]\\`` matter, which byte-level and
    SentencePiece vocabularies spell as themselves.
    """

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self, depth: int = 0, in_string: bool = False, escaped: bool = False):
        self.depth, self.in_string, self.escaped = depth, in_string, escaped

    def after(self, text: str) -> JsonDepth:
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        for ch in text:
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
        return JsonDepth(depth, in_string, escaped)

    @property
    def distance(self) -> int:
        return self.depth + int(self.in_string)


class GrammarTokenizer:
    """The llguidance view of a tokenizer (about 0.5 s to build for a 49K vocabulary; built once)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        import llguidance.hf

        eos = sorted(set(eos_token_ids)) or None
        try:
            self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError:
            # transformers 5 fast tokenizers are TokenizersBackend, not PreTrainedTokenizerFast
            from copy import copy

            backend = copy(tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            self.ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        count = min(vocab_size, len(tokenizer))
        self.token_texts = [t or "" for t in tokenizer.convert_ids_to_tokens(list(range(count)))]
        # Tokens that can open or close a JSON string or container: the only ones whose effect
        # on JsonDepth depends on more than "leave it as it is".
        self.structural_ids = np.array([i for i, t in enumerate(self.token_texts) if _STRUCTURAL.intersection(t)], dtype=np.int64)

    def matcher(self, grammar: str):
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        if error:
            raise StructuredOutputError(f"the schema cannot be compiled into a grammar: {error.strip()}")
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"the schema cannot be compiled into a grammar: {matcher.get_error()}")
        return matcher


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)
_BITS = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int32 [rows, ceil(vocab/32)]`` -> ``bool [rows, vocab]`` (bit ``j % 32`` of word ``j // 32``)."""
    bits = (bitmask.to(torch.int64).unsqueeze(-1) & _BITS) != 0
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


class BatchConstraint:
    """Per-row grammar matchers for one decode run; ``None`` rows are unconstrained."""

    def __init__(self, matchers: Sequence[Any | None], grammar_tokenizer: GrammarTokenizer, max_new_tokens: int | None = None):
        self.matchers = list(matchers)
        self.grammar_tokenizer = grammar_tokenizer
        self.vocab_size = vocab_size = grammar_tokenizer.vocab_size
        self.eos_token_ids = eos_token_ids = grammar_tokenizer.eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.steps = 0
        self._json = [JsonDepth() for _ in self.matchers]
        self.closing_steps = [0 for _ in self.matchers]  # steps each row was steered to close its JSON
        self._words = (vocab_size + 31) // 32
        self._bitmask = torch.full((len(self.matchers), self._words), -1, dtype=torch.int32)
        # A finished grammar (llguidance stops once nothing but EOS can follow) allows only EOS.
        eos_only = torch.zeros(self._words * 32, dtype=torch.bool)
        eos_only[[t for t in eos_token_ids if t < vocab_size]] = True
        self._eos_only = (eos_only.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(-1).to(torch.int32)
        self.step_seconds: list[float] = []  # mask + advance per step: the constraint's overhead

    @classmethod
    def build(cls, grammar_tokenizer: GrammarTokenizer, specs: Sequence[OutputSpec], max_new_tokens: int | None = None) -> BatchConstraint | None:
        """``max_new_tokens``: the rows' token budget, for steering unfinished JSON to close (None: never)."""
        grammars = [grammar_for(s) for s in specs]
        if all(g is None for g in grammars):
            return None
        matchers = [grammar_tokenizer.matcher(g) if g is not None else None for g in grammars]
        return cls(matchers, grammar_tokenizer, max_new_tokens)

    def subset(self, indices: Sequence[int]) -> BatchConstraint | None:
        """The constraint of some rows (before any step), for a batch that runs in buckets."""
        matchers = [self.matchers[i] for i in indices]
        if all(m is None for m in matchers):
            return None
        return BatchConstraint(matchers, self.grammar_tokenizer, self.max_new_tokens)

    def _active(self) -> list[int]:
        return [i for i, m in enumerate(self.matchers) if m is not None and not m.is_stopped()]

    def _constrained(self) -> list[int]:
        return [i for i, m in enumerate(self.matchers) if m is not None]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Set disallowed logits of constrained rows to -inf (in place); returns ``logits``."""
        start = time.perf_counter()
        rows = self._constrained()
        if rows:
            row_bytes = self._words * 4
            for i in rows:
                matcher = self.matchers[i]
                assert matcher is not None  # _constrained() yields rows with a grammar
                if matcher.is_stopped():
                    self._bitmask[i] = self._eos_only
                    continue
                matcher.unsafe_compute_mask_ptr(self._bitmask[i].data_ptr(), row_bytes)
                if matcher.is_error():
                    raise StructuredOutputError(f"constrained decoding failed: {matcher.get_error()}")
                if self._closing() and not matcher.is_accepting() and self._steer_to_close(i):
                    self.closing_steps[i] += 1
            if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
                # numpy, single-threaded: a few small torch ops per step cost 10-50x more on a
                # busy CPU, where each waits for its intra-op thread pool
                bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
                width = min(logits.shape[-1], bits.shape[-1])
                for i in rows:
                    row = logits[i].numpy()
                    np.copyto(row[:width], -np.inf, where=~bits[i, :width].astype(bool))
                    row[width:] = -np.inf  # a padded lm_head: the extra ids are never allowed
            else:
                index = torch.tensor(rows, device=logits.device)
                allowed = unpack_bitmask(self._bitmask[rows], logits.shape[-1]).to(logits.device)
                if allowed.shape[-1] < logits.shape[-1]:
                    allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - allowed.shape[-1]))
                logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        self._elapsed = time.perf_counter() - start
        return logits

    @property
    def closing(self) -> bool:
        """Whether steps now steer unfinished JSON to close (masks then depend on the step; drafts stop here)."""
        return self._closing()

    def _closing(self) -> bool:
        return self.max_new_tokens is not None and self.steps >= self.max_new_tokens - closing_reserve(self.max_new_tokens)

    def _steer_to_close(self, row: int) -> bool:
        """Narrow row ``row``'s allowed tokens to those that bring its JSON nearest to closed.

        Among allowed tokens that open or close strings or containers, keep those that lower
        the distance most; if none lowers it, drop the ones that raise it (opening a new string
        or container) as long as something stays allowed. Returns whether the mask changed.
        """
        words = self._bitmask[row].numpy()
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
        ids = self.grammar_tokenizer.structural_ids
        candidates = ids[allowed[ids]]
        if candidates.size == 0:
            return False
        state, texts = self._json[row], self.grammar_tokenizer.token_texts
        deltas = np.array([state.after(texts[t]).distance for t in candidates]) - state.distance
        if deltas.min() < 0:
            allowed[:] = False
            allowed[candidates[deltas == deltas.min()]] = True
        else:
            rising = candidates[deltas > 0]
            if rising.size == 0 or rising.size == int(allowed.sum()):
                return False
            allowed[rising] = False
        words[:] = np.packbits(allowed, bitorder="little").view(np.int32)
        return True

    def advance(self, tokens: Sequence[int]) -> None:
        """Feed each constrained row the token it was given."""
        start = time.perf_counter()
        texts = self.grammar_tokenizer.token_texts
        for i in self._active():
            token = int(tokens[i])
            matcher = self.matchers[i]
            assert matcher is not None  # _active() yields rows with a grammar
            if not matcher.consume_token(token):
                raise StructuredOutputError(f"constrained decoding rejected token {token}: {matcher.get_error()}")
            accepting = matcher.is_accepting() or matcher.is_stopped()
            self._json[i] = JsonDepth() if accepting else self._json[i].after(texts[token] if token < len(texts) else "")
        self.steps += 1
        self.step_seconds.append(getattr(self, "_elapsed", 0.0) + time.perf_counter() - start)

    def complete(self, row: int) -> bool:
        """Whether row ``row``'s output so far is a whole sentence of its grammar (True if unconstrained)."""
        matcher = self.matchers[row]
        return matcher is None or matcher.is_stopped() or matcher.is_accepting()

    @property
    def ms_per_step(self) -> float | None:
        if not self.step_seconds:
            return None
        ordered = sorted(self.step_seconds)
        return ordered[len(ordered) // 2] * 1000

"""Continuous batching: one worker thread owns the model; requests join the running decode
batch after their prefill and leave it when they finish.

Every engine call goes through :class:`Scheduler`. Work on the model runs only in its worker,
in this order, over and over: one queued task or one chunk of it (a request's prefill, a
``score``, a chunk's K/V), then one decode step of every running request. A prefill that
starts while requests are decoding runs in chunks of ``prefill_chunk_tokens`` (see
:meth:`~snapkv_rag.engine.generation.DecodeRun.prefill_steps`), so running streams wait at most one
chunk between two tokens, and a new request waits at most one step and one chunk to start.

A request's prefill is the engine's own (:class:`~snapkv_rag.engine.generation.DecodeRun`: prefix
cache, chunk K/V reuse, layer-wise compression with its own policy and budget). Afterwards:

- **Shared group.** A request whose cache is plain K/V (no decode-time policy state, no
  sliding-window layers) joins the shared group: its compressed cache is left-padded into the
  group's ``[rows, kv_heads, width, head_dim]`` per layer with a 2-D mask row and its own next
  positions, and every step is one forward for all rows. Finished and cancelled requests
  leave with ``index_select``; columns that are padding in every remaining row are dropped.
- **Solo group.** A request whose policy keeps state while decoding (LESS's folded state,
  decode-time cuts) or a model with sliding-window layers decodes on its own cache, one forward
  per step, interleaved with the shared group's.

With ``compile_decode`` on, a shared group's forwards (one token per row, or a lone member's token
and its draft) run the compiled step over static buffers (:mod:`.compiled_decode`); each request's
``stats.decode_step`` says whether its steps ran compiled, and why not.

A request that asks for prompt-lookup drafts (``prompt_lookup_num_tokens``, :mod:`.lookup`)
checks a draft with each forward while it decodes alone: in a solo group, or as the only row
of a shared group. Beside other rows it decodes one token per step (a batch of drafts costs
every row the longest draft's forward).

Each request samples with its own parameters, grammar and seed, and its text and tool-call
streams are fed here, so a stop string ends its rows at once. Events go to the request's
outbox; a consumer that reads slowly or not at all never holds the worker back.
"""

from __future__ import annotations

import atexit
import contextvars
import inspect
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from ..compression.decoding import layer_entries
from ..compression.quantized import cache_kv_bits
from ..model.device_clock import device_clock
from ..model.openmp import release_thread_pool
from ..tools.calls import ToolCallStream
from .compiled_decode import HEADROOM, CompiledDecode, StaticBatch
from .detokenize import SequenceText
from .generation import cache_bytes, choose_tokens, model_forward
from .lookup import Drafter, draft_blocker, draft_input, drop_last
from .sampling import make_generator

if TYPE_CHECKING:
    from .generation import DecodeRun
    from .requests import Request
    from .streams import StreamPiece

DONE = object()  # the last event of a member's outbox
#: While requests decode, background tasks (Engine.run_on_model(..., background=True): a server's
#: embeddings) get at most this share of the decode steps' time: a chat beside a flood of
#: 2,048-input embedding requests took 2.6x its time alone with one batch of 8 texts per step.
BACKGROUND_SHARE = 0.25
IDLE_SECONDS = 10.0  # the worker thread exits after this long with nothing to do (a new call starts another)
# Every scheduler, so the interpreter's exit can stop their workers first: a daemon worker still
# inside torch while C++ static destructors run aborted the process ("terminate called without
# an active exception", exit status -6) now and then.
_SCHEDULERS: weakref.WeakSet[Scheduler] = weakref.WeakSet()


def default_max_batch_size(device: torch.device) -> int:
    """Rows decoded together by default: on a CPU a step's cost grows with the rows once the
    weights stop dominating (measured in eval/serving/RESULTS.md, "Continuous batching"); a GPU takes many more."""
    return 64 if device.type == "cuda" else 16


class Member:
    """One request's rows while they decode: the prefilled run, sampling and text state, an outbox."""

    def __init__(self, run: DecodeRun, request: Request, tokenizer, eos_ids: frozenset[int], cancel: threading.Event) -> None:
        self.run = run
        self.params = request.params
        stop_ids = frozenset() if self.params.ignore_eos else eos_ids
        self.texts = [SequenceText(tokenizer, self.params.stop, stop_ids) for _ in request.rows]
        self.calls = [ToolCallStream() if request.spec(i).calls_tools else None for i in range(len(request.rows))]
        self.cancel = cancel
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.generator = make_generator(self.params, run.device)
        self.logits = run.last_logits  # [rows, vocab] the next tokens are chosen from (the prefill's, on joining)
        self.steps = 0
        self.cancelled = False
        self.batch_rows_max = 0  # the most rows decoded in one forward with this request's
        self.kv_bytes_final = 0
        self.drafter: Drafter | None = None  # prompt-lookup drafts (None: not asked, or not exact here)
        self.draft_off: str | None = None  # why drafts were asked for and not used
        self.accepted_last = 0  # draft tokens the latest forward accepted
        self.compiled_steps = 0  # decode forwards that ran the compiled step
        self.eager_steps = 0
        self.eager_reason: str | None = None  # why the latest eager forward was not compiled
        if self.params.prompt_lookup_num_tokens:
            self.draft_off = draft_blocker(run, self.params)
            if self.draft_off is None:
                self.drafter = Drafter(run.rows[0], self.params.prompt_lookup_num_tokens)

    @property
    def rows(self) -> int:
        return self.run.batch_size

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_new_tokens or all(t.finished for t in self.texts)

    def pieces(self, row: int, piece: str) -> Iterator[tuple[int, StreamPiece]]:
        """``(row, piece)`` events for released text: plain text, or tool-call deltas with tools."""
        if not piece:
            return
        call = self.calls[row]
        if call is None:
            yield row, piece
        else:
            for event in call.feed(piece):
                yield row, event

    def advance(self) -> torch.Tensor:
        """Choose every row's next token, feed the text streams and post what they release."""
        run = self.run
        tokens = choose_tokens(self.logits, self.steps, self.params, self.generator, run.eos_ids, run.constraint)
        self.accepted_last = 0
        self._take(tokens.tolist())
        return tokens

    def _take(self, tokens: list[int]) -> None:
        """One generated token per row: feed the text streams and post what they release."""
        self.steps += 1
        for i, token in enumerate(tokens):
            for event in self.pieces(i, self.texts[i].add(token)):
                self.outbox.put(event)
            call = self.calls[i]
            if call is not None and call.duplicate:
                self.texts[i].end()  # a repeated call: the turn's calls are all written
        if self.drafter is not None:
            self.drafter.generated(tokens[0])

    def ran(self, compiled: bool, reason: str | None = None) -> None:
        if compiled:
            self.compiled_steps += 1
        else:
            self.eager_steps += 1
            self.eager_reason = reason

    def decode_step(self) -> str:
        """How this member's decode forwards ran: ``"compiled"``, ``"eager (why)"`` or both, counted."""
        if not self.eager_steps:
            return "compiled" if self.compiled_steps else "none"
        eager = f"eager ({self.eager_reason})" if self.eager_reason else "eager"
        return f"{self.compiled_steps} compiled, {self.eager_steps} {eager}" if self.compiled_steps else eager

    def drafts_stats(self) -> dict[str, Any] | None:
        """What drafting did (None: not asked for)."""
        if self.drafter is not None:
            return self.drafter.stats.to_dict()
        if self.draft_off is not None:
            return {"prompt_lookup_num_tokens": self.params.prompt_lookup_num_tokens, "draft_off": self.draft_off}
        return None

    def draft_step(self, token: torch.Tensor, extend: Callable[[torch.Tensor], torch.Tensor], drop: Callable[[int], None]) -> bool:
        """Decode ``token [1]`` with a draft after it, if the text so far has one: ``extend``
        runs ``[1, 1 + k]`` tokens and returns their logits ``[1 + k, vocab]``, ``drop(n)``
        removes the last ``n`` entries. Draft tokens are taken while greedy decoding would have
        chosen them; the logits after the last one taken are this member's next. False: no draft
        (the caller decodes ``token`` alone)."""
        assert self.drafter is not None
        draft = self.drafter.draft(self.params.max_new_tokens - self.steps)
        if not draft:
            self.drafter.record(0, 0)
            return False
        logits = extend(draft_input(token, draft))
        constraint = self.run.constraint
        accepted = 0
        for i, proposed in enumerate(draft):
            if self.done or (constraint is not None and constraint.closing):
                break
            # the grammar's mask (in place) without advancing it: a rejected position's token is chosen again, from the same state
            row = constraint.mask(logits[i : i + 1]) if constraint is not None else logits[i : i + 1]
            if int(choose_tokens(row, self.steps, self.params, None, self.run.eos_ids, None)) != proposed:
                break
            if constraint is not None:
                constraint.advance([proposed])
            self._take([proposed])
            accepted += 1
        drop(len(draft) - accepted)
        self.logits = logits[accepted : accepted + 1]
        self.accepted_last = accepted
        self.drafter.record(len(draft), accepted)
        return True

    def finish(self, error: BaseException | None = None) -> None:
        """Tell the reader that this member is done (with ``error`` when it failed)."""
        if error is not None:
            self.outbox.put(error)
        self.outbox.put(DONE)

    def abandon(self) -> None:
        """End a member whose request was cancelled before it could join the batch."""
        self.cancelled = True
        self.finish()

    def events(self) -> Iterator[tuple[int, StreamPiece]]:
        """The outbox until the scheduler lets go of this member (re-raises its error)."""
        while True:
            event = self.outbox.get()
            if event is DONE:
                return
            if isinstance(event, BaseException):
                raise event
            yield event


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class SharedGroup:
    """Requests with plain K/V caches, decoding as one left-padded batch."""

    def __init__(self, model, compiled: CompiledDecode | None = None) -> None:
        self.model = model
        self.compiled = compiled
        self.members: list[Member] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, width]: 1 = a real entry; None = no padding
        self.positions: torch.Tensor | None = None  # [rows, 1]: each row's latest position
        # while decoding compiled, the entries live here (the cache's layers are empty) until rows
        # join or leave, or a forward runs eager: _to_dynamic puts them back
        self.static: StaticBatch | None = None
        self._draft_reason: str | None = None  # why the latest draft check ran eager (None: compiled)

    @staticmethod
    def refusal(run: DecodeRun) -> str | None:
        """Why ``run`` cannot decode in a shared batch (None: it can)."""
        if run.invariant:
            return "the invariant mode decodes each request alone"
        if run.policy_state is not None:
            return "the policy keeps state while decoding (LESS, decode-time cuts)"
        if run.span_attention is not None:
            return "span attention is recorded"
        if run.ragged_heads:
            return "per-head budgets"
        if any(run.sliding):
            return "sliding-window layers"
        if len(set(run.kept_tokens_per_layer)) != 1:
            return "per-layer budgets"
        return None

    @classmethod
    def accepts(cls, run: DecodeRun) -> bool:
        return cls.refusal(run) is None

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.members)

    @property
    def width(self) -> int:
        if self.static is not None:
            return self.static.width
        return layer_entries(self.cache.layers[0]) if self.cache is not None else 0

    def fits(self, run: DecodeRun) -> bool:
        """Whether ``run``'s rows should join: widths within 2x (+64) of each other, so that
        padding every row to the widest stays cheap (a full 32K-token cache beside 256-entry
        SnapKV rows gets a group of its own), and entries stored at the same width (``kv_bits``)."""
        if not self.members:
            return True
        if cache_kv_bits(self.cache) != run.kv_bits:
            return False
        a, b = sorted((self.width, run.kept_tokens_per_layer[0]))
        return b <= 2 * a + 64

    def add(self, member: Member) -> None:
        self._to_dynamic()
        cache, mask, positions = member.run.hand_over()
        if not self.members:
            self.cache, self.mask, self.positions = cache, mask, positions
        else:
            assert self.positions is not None
            rows, width = self.rows, max(self.width, layer_entries(cache.layers[0]))
            mine = self.mask if self.mask is not None else self.positions.new_ones(rows, self.width)
            theirs = mask if mask is not None else positions.new_ones(member.rows, layer_entries(cache.layers[0]))
            # built aside and committed at once: running out of memory here leaves the group as it was
            new_mask = torch.cat([_pad_left(mine, width, 1), _pad_left(theirs, width, 1)])
            layers = [
                (
                    torch.cat([_pad_left(layer.keys, width, 2), _pad_left(joining.keys, width, 2)]),
                    torch.cat([_pad_left(layer.values, width, 2), _pad_left(joining.values, width, 2)]),
                )
                for layer, joining in zip(self.cache.layers, cache.layers)
            ]
            new_positions = torch.cat([self.positions, positions])
            for layer, (keys, values) in zip(self.cache.layers, layers):
                layer.keys, layer.values = keys, values
            self.mask, self.positions = new_mask, new_positions
            self._drop_dead_columns()
        self.members.append(member)

    def held_bytes(self) -> int:
        """The K/V this group holds (padding included; the static buffers' whole capacity while compiled)."""
        if self.static is not None:
            return self.static.nbytes
        return cache_bytes(self.cache) if self.cache is not None else 0

    def _row_slices(self) -> dict[int, slice]:
        slices, start = {}, 0
        for m in self.members:
            slices[id(m)] = slice(start, start + m.rows)
            start += m.rows
        return slices

    def kv_bytes(self, member: Member) -> int:
        """The member's real cached entries (padding excluded), all layers."""
        rows = self._row_slices()[id(member)]
        mask = self.static.valid[:, : self.static.width] if self.static is not None else self.mask
        entries = int(mask[rows].sum()) if mask is not None else member.rows * self.width
        return round(entries * sum(member.run.token_bytes_per_layer))

    def remove(self, gone: list[Member]) -> None:
        self._to_dynamic()
        slices = self._row_slices()
        staying = [m for m in self.members if m not in gone]
        if not staying:
            self.members, self.cache, self.mask, self.positions = [], None, None, None
            return
        assert self.positions is not None
        rows = torch.tensor([r for m in staying for r in range(slices[id(m)].start, slices[id(m)].stop)], device=self.positions.device)
        for layer in self.cache.layers:
            layer.batch_select_indices(rows)
        self.positions = self.positions.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows) if self.mask is not None else None
        self.members = staying
        self._drop_dead_columns()

    def _drop_dead_columns(self) -> None:
        """Drop cache columns that no row attends to (padding everywhere); no mask when none is left."""
        if self.mask is None:
            return
        live = self.mask.bool().any(0)
        if not bool(live.all()):
            columns = live.nonzero().squeeze(-1)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(2, columns)
                layer.values = layer.values.index_select(2, columns)
            self.mask = self.mask.index_select(1, columns)
        if bool(self.mask.bool().all()):
            self.mask = None

    def step(self, tokens: list[torch.Tensor]) -> None:
        """One forward for every row; ``tokens`` per member, in member order. A lone drafting
        member's forward checks its draft too."""
        if len(self.members) == 1 and self.members[0].drafter is not None:
            if self.members[0].draft_step(tokens[0], self._extend_all, self._drop_last):
                self.members[0].ran(self._draft_reason is None, self._draft_reason)
                return
        for m in self.members:
            if m.drafter is not None and len(self.members) > 1:
                m.drafter.record(0, 0)
                m.drafter.stats.shared_steps += 1
        logits, reason = self._run(torch.cat(tokens)[:, None])
        for m, part in zip(self.members, logits[:, -1].split([m.rows for m in self.members])):
            m.logits = part
            m.ran(reason is None, reason)

    def _run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """Append ``tokens [rows, t]`` after every row's latest position: the logits ``[rows, t, vocab]``,
        and why the forward ran eager (None: it ran compiled)."""
        reason = self._compiled_refusal()
        if reason is None:
            assert self.compiled is not None and self.positions is not None
            t = tokens.shape[1]
            if self.static is not None and not self.static.fits(t):
                self._to_dynamic()
            if self.static is None:
                remaining = max(m.params.max_new_tokens - m.steps for m in self.members)
                self.static = self.compiled.load(self.cache, self.mask, max(t, min(remaining, HEADROOM)))
                if self.static is not None:
                    for layer in self.cache.layers:  # the buffers hold the entries now
                        layer.keys, layer.values = layer.keys.new_empty(0), layer.values.new_empty(0)
            positions = self.positions + 1 + torch.arange(t, device=tokens.device)
            logits = self.compiled.step(self.static, tokens, positions) if self.static is not None else None
            if logits is not None:
                self.positions = positions[:, -1:]
                return logits, None
            reason = self.compiled.refusal() or self.compiled.transient
        self._to_dynamic()
        return self._extend(tokens, last_only=False), reason

    def _compiled_refusal(self) -> str | None:
        if self.compiled is None:
            return "compile_decode is off"
        reason = self.compiled.refusal()
        if reason is None and cache_kv_bits(self.cache) is not None:
            reason = "kv_bits: quantized entries decode eager"
        return reason

    def _to_dynamic(self) -> None:
        """Give the entries back to the cache's layers (views of the static buffers)."""
        if self.static is not None:
            self.mask = self.static.unload(self.cache)
            self.static = None

    def _extend(self, tokens: torch.Tensor, *, last_only: bool = True) -> torch.Tensor:
        """Append ``tokens [rows, t]`` after every row's latest position; their logits."""
        self._to_dynamic()
        assert self.positions is not None
        t = tokens.shape[1]
        positions = self.positions + 1 + torch.arange(t, device=tokens.device)
        self.positions = positions[:, -1:]
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.rows, t)], dim=-1)
        return model_forward(self.model, self.cache, tokens, self.mask, positions, last_only=last_only)

    def _extend_all(self, tokens: torch.Tensor) -> torch.Tensor:
        logits, self._draft_reason = self._run(tokens)
        return logits[0]

    def _drop_last(self, count: int) -> None:
        if count <= 0:
            return
        assert self.positions is not None
        if self.static is not None:
            self.static.drop(count)
            self.positions = self.positions - count
            return
        drop_last(self.cache, count)
        self.positions = self.positions - count
        if self.mask is not None:
            self.mask = self.mask[:, :-count]


class SoloGroup:
    """One request decoding on its own cache (its policy keeps state between steps, or the
    model has sliding-window layers)."""

    def __init__(self, member: Member, reason: str | None = None):
        self.members = [member]
        self.reason = reason  # why it decodes alone, hence eager

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.members)

    def kv_bytes(self, member: Member) -> int:
        return cache_bytes(member.run.cache)

    def remove(self, gone: list[Member]) -> None:
        self.members = [m for m in self.members if m not in gone]

    def step(self, tokens: list[torch.Tensor]) -> None:
        (member,) = self.members
        run = member.run
        member.ran(False, self.reason)
        if member.drafter is not None and member.draft_step(tokens[0], run.extend_all, run.drop_last):
            run.after_step()
            return
        member.logits = run.decode_step(tokens[0])


Group = SharedGroup | SoloGroup


@dataclass
class _Task:
    fn: Callable[[], Any]  # returns the result, or a generator that yields between chunks and returns it
    rows: int  # decode rows the task adds (a prefill); 0 for other model work
    context: contextvars.Context
    background: bool = False  # work nobody decoding waits for (a server's embeddings): see Scheduler._next_task
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    steps: Generator[Any, None, Any] | None = None

    def advance(self) -> bool:
        """Run the task, or its next chunk, in the caller's context; True once it has finished."""
        try:
            if self.steps is None:
                out = self.context.run(self.fn)
                if not inspect.isgenerator(out):
                    self.result = out
                    self.done.set()
                    return True
                self.steps = cast(Generator[Any, None, Any], out)
            steps = self.steps
            self.context.run(lambda: next(steps))
            return False
        except StopIteration as stop:
            self.result = stop.value
        except BaseException as exc:  # re-raised in the caller's thread
            self.error = exc
        self.done.set()
        return True


@dataclass
class SchedulerStats:
    running_requests: int
    running_rows: int
    waiting_tasks: int
    decode_steps: int  # forwards of decode steps so far (each group's counts once)
    decoded_rows: int  # rows those forwards decoded: decoded_rows / decode_steps is the mean batch
    kv_bytes: int  # K/V held by running requests (padding included)


class Scheduler:
    """The engine's model worker: tasks and decode steps, in one thread (see the module doc)."""

    def __init__(self, model, max_batch_size: int, compiled: CompiledDecode | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.compiled = compiled  # the compiled decode step shared groups use (None: eager)
        self._model = model
        self._device = next(model.parameters()).device if model is not None else torch.device("cpu")
        self._cv = threading.Condition()
        self._tasks: deque[_Task] = deque()
        self._active: _Task | None = None  # a chunked task between two of its chunks
        self._groups: list[Group] = []
        self._worker: threading.Thread | None = None
        self._stopping = False
        self._decode_steps = 0
        self._decoded_rows = 0
        # seconds of background tasks and of decode steps since requests began decoding (the share's books)
        self._background_seconds = 0.0
        self._decode_seconds = 0.0
        _SCHEDULERS.add(self)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the worker at its next iteration (running requests are abandoned) and wait for it.

        For the interpreter's exit: calls after it are not served."""
        with self._cv:
            self._stopping = True
            worker = self._worker
            self._cv.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)

    # ----------------------------------------------------------------- callers' side
    def call(self, fn: Callable[[], Any], *, rows: int = 0, background: bool = False) -> Any:
        """Run ``fn()`` in the worker, between decode steps, in the caller's context; its result.

        ``fn`` may return a generator instead: the worker then advances it once per iteration
        (a chunk of a prefill), with a decode step between, and its return value is the result.
        ``rows``: decode rows ``fn`` will add (a prefill that joins); it waits until the running
        rows plus these fit in ``max_batch_size`` (or nothing runs). ``background``: other tasks
        go first, and while requests decode, background work takes at most
        :data:`BACKGROUND_SHARE` of the worker's time beside their steps.
        """
        if self.on_worker():  # model work inside a task: run it now, whole
            task = _Task(fn, rows, contextvars.copy_context())
            while not task.advance():
                pass
            if task.error is not None:
                raise task.error
            return task.result
        task = _Task(fn, rows, contextvars.copy_context(), background=background)
        with self._cv:
            self._tasks.append(task)
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name="snapkv-rag-model", daemon=True)
                self._worker.start()
            self._cv.notify()
        release_thread_pool()  # this thread's idle OpenMP threads would slow the worker's (snapkv_rag.model.openmp)
        task.done.wait()
        if task.error is not None:
            raise task.error
        return task.result

    def join(self, member: Member) -> None:
        """Start decoding ``member`` (from inside a task, in the worker)."""
        assert self.on_worker(), "join() is called by a task, in the worker"
        member.logits = member.run.last_logits
        refusal = SharedGroup.refusal(member.run)
        if refusal is not None:
            self._groups.append(SoloGroup(member, refusal))
            return
        group = next((g for g in self._groups if isinstance(g, SharedGroup) and g.fits(member.run)), None)
        if group is None:
            group = SharedGroup(self._model, self.compiled)
            self._groups.append(group)
        try:
            group.add(member)
        except Exception as exc:  # out of memory joining: this request ends with the error, the others go on
            if not group.members:
                self._groups.remove(group)
            member.finish(exc)

    def on_worker(self) -> bool:
        return threading.current_thread() is self._worker

    @property
    def decoding(self) -> bool:
        """Whether requests are decoding now (a new prefill then goes in chunks)."""
        return bool(self._groups)

    def stats(self) -> SchedulerStats:
        groups = list(self._groups)  # read from other threads: a snapshot, exact between steps
        members = [m for g in groups for m in g.members]
        kv = 0
        for g in groups:
            try:
                kv += g.held_bytes() if isinstance(g, SharedGroup) else sum(cache_bytes(m.run.cache) for m in g.members)
            except (AttributeError, RuntimeError):  # changed under us mid-step
                pass
        return SchedulerStats(len(members), sum(m.rows for m in members), len(self._tasks), self._decode_steps, self._decoded_rows, kv)

    # ----------------------------------------------------------------- the worker
    def _running_rows(self) -> int:
        return sum(g.rows for g in self._groups)

    def _next_task(self) -> _Task | None:
        """FIFO, except that model work adding no rows never waits behind a prefill that does not fit,
        and background tasks come last and, while requests decode, only within their share."""
        running = self._running_rows()
        blocked = False  # a prefill waits for room: later prefills wait behind it (FIFO)
        waiting_background = None
        for task in self._tasks:
            if task.background:
                waiting_background = waiting_background or task
                continue
            if task.rows == 0 or (not blocked and (running == 0 or running + task.rows <= self.max_batch_size)):
                self._tasks.remove(task)
                return task
            blocked = True
        if waiting_background is not None and (not self._groups or self._background_seconds <= BACKGROUND_SHARE * self._decode_seconds):
            self._tasks.remove(waiting_background)
            return waiting_background
        return None

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while self._iterate():
                    pass
        except BaseException as exc:  # the worker itself failed: nobody may wait for it forever
            self._fail_everything(exc)
            raise

    def _iterate(self) -> bool:
        """One task (or chunk) and one decode step; False when the worker should exit (idle)."""
        with self._cv:
            idle = not self._tasks and not self._groups and self._active is None
            if idle and not self._stopping:
                release_thread_pool()  # an idle engine's OpenMP threads would slow other threads' torch work
                self._cv.wait(IDLE_SECONDS)
                idle = not self._tasks and not self._groups
            if idle or self._stopping:
                self._worker = None
                return False
            task = self._active or self._next_task()
        if not self._groups:
            self._background_seconds = self._decode_seconds = 0.0
        if task is not None:
            started = time.perf_counter()
            self._active = None if task.advance() else task
            if task.background and self._groups:
                self._background_seconds += time.perf_counter() - started
            task = None  # hold no finished task (its closure, its member) through an idle wait
        if self._groups:
            started = time.perf_counter()
            try:
                self._step()
            except BaseException as exc:  # a bug: every running request gets it, none hangs
                groups, self._groups = self._groups, []
                for group in groups:
                    for member in group.members:
                        member.finish(exc)
            self._decode_seconds += time.perf_counter() - started
        return True

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cv:
            self._worker = None
            tasks, self._tasks = list(self._tasks), deque()
            if self._active is not None:
                tasks.append(self._active)
            self._active = None
            groups, self._groups = self._groups, []
        for task in tasks:
            task.error = exc
            task.done.set()
        for group in groups:
            for member in group.members:
                member.finish(exc)

    def _step(self) -> None:
        for group in list(self._groups):
            leaving: list[Member] = []
            tokens: list[torch.Tensor] = []
            for member in group.members:
                if member.cancel.is_set():
                    member.cancelled = True
                    leaving.append(member)
                    continue
                if member.done:  # its last forward's accepted draft tokens finished it
                    leaving.append(member)
                    continue
                try:
                    chosen = member.advance()
                except Exception as exc:  # its grammar or stop handling failed: this request alone ends
                    self._leave(group, [member], exc)
                    leaving.append(member)
                    continue
                if member.done:
                    leaving.append(member)
                else:
                    tokens.append(chosen)
            self._leave(group, [m for m in leaving if m in group.members])
            if group.members:
                self._forward(group, tokens)
            if not group.members:
                self._groups.remove(group)

    def _forward(self, group: Group, tokens: list[torch.Tensor]) -> None:
        start = device_clock(self._device)
        try:
            group.step(tokens)
        except Exception as exc:  # out of memory, say: this group's requests end with the error
            self._leave(group, list(group.members), exc)
            return
        seconds = device_clock(self._device) - start
        rows = group.rows
        self._decode_steps += 1
        self._decoded_rows += rows
        for member in group.members:
            member.run.timings.step_seconds.append(seconds)
            member.run.timings.step_tokens.append(1 + member.accepted_last)
            member.batch_rows_max = max(member.batch_rows_max, rows)

    def _leave(self, group: Group, members: list[Member], error: BaseException | None = None) -> None:
        if not members:
            return
        try:
            for member in members:
                try:
                    member.kv_bytes_final = group.kv_bytes(member)
                except Exception:  # the group's cache is what failed
                    member.kv_bytes_final = 0
            group.remove(members)
        finally:  # whatever removing them costs or raises, their readers hear of the end
            for member in members:
                member.finish(error)


@atexit.register
def _stop_workers() -> None:
    for scheduler in list(_SCHEDULERS):
        scheduler.stop()

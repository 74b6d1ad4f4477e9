"""Incremental detokenization of one sequence, with stop strings and end-of-sequence tokens.

Text is released only when it is final: an incomplete UTF-8 character (decoded as U+FFFD)
or a tail that could still grow into a stop string is held back until the next token
settles it, so streamed pieces always concatenate to exactly the non-streamed text.
"""

from __future__ import annotations


class SequenceText:
    def __init__(self, tokenizer, stop: tuple[str, ...], eos_token_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self._stop = stop
        self._eos = eos_token_ids
        self.token_ids: list[int] = []  # text tokens (the EOS token is not kept)
        self.generated = 0  # every token the model produced for this sequence, EOS included
        self.text = ""  # released so far
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int) -> str:
        """Take one generated token; return the newly released text (may be empty)."""
        if self.finished:
            return ""
        self.generated += 1
        if token_id in self._eos:
            self.finish_reason = "stop"
            return self._release(self._complete(self._decode()), final=True)
        self.token_ids.append(token_id)
        full = self._decode()
        cut = self._first_stop(self._complete(full))
        if cut is not None:
            self.finish_reason = "stop"
            return self._release(full[:cut], final=True)
        return self._release(full, final=False)

    def end(self) -> None:
        """End the sequence now, as a stop would (the caller decided the output is complete)."""
        if not self.finished:
            self.finish_reason = "stop"

    def finish_for_length(self) -> str:
        """Mark the sequence as cut by ``max_new_tokens``; release what was held back.

        A character whose bytes were cut off by the limit (decoded as U+FFFD) is dropped.
        """
        if self.finished:
            return ""
        self.finish_reason = "length"
        return self._release(self._complete(self._decode()), final=True)

    def _decode(self) -> str:
        return self._tokenizer.decode(self.token_ids, skip_special_tokens=True)

    @staticmethod
    def _complete(full: str) -> str:
        """``full`` without a trailing incomplete UTF-8 character (U+FFFD from the decoder)."""
        return full.rstrip("\ufffd")

    def _first_stop(self, full: str) -> int | None:
        longest = max((len(s) for s in self._stop), default=0)
        start = max(0, len(self.text) - longest)
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, full: str) -> int:
        """Characters at the end of ``full`` that are not final yet.

        An incomplete trailing character is held back, and so is whatever before it could
        still grow into a stop string (the stop string may continue with that character).
        """
        complete = self._complete(full)
        held = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(complete)), 0, -1):
                if complete.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held + len(full) - len(complete)

    def _release(self, full: str, *, final: bool) -> str:
        end = len(full) if final else len(full) - self._held_back(full)
        # Released text is never revised, so the streamed pieces always add up to .text.
        if end <= len(self.text) or not full.startswith(self.text):
            return ""
        delta = full[len(self.text) : end]
        self.text = full[:end]
        return delta

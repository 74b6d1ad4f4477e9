"""Turn a prompt string or a list of chat messages into token ids, exactly once.

Rules:
- chat messages always go through the tokenizer's chat template (with the generation prompt);
- a plain string is wrapped as one user message when the model has a chat template, unless
  ``chat=False`` asks for raw completion;
- the resulting ids carry exactly one BOS when the model uses one: the template's own BOS
  is not doubled by the tokenizer, and a tokenizer that adds BOS to plain text gets it back
  when a template lacks it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Union

from .errors import EmptyPromptError, InvalidPromptError

Message = Mapping[str, Any]
PromptLike = Union[str, Sequence[Message]]

_ROLES = {"system", "user", "assistant", "tool"}


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Validate chat messages (dicts or objects with ``role``/``content``) into plain dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidPromptError("messages must be a list of {'role': ..., 'content': ...} mappings")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if isinstance(msg, Mapping):
            role, content = msg.get("role"), msg.get("content")
            extra = {k: v for k, v in msg.items() if k not in ("role", "content")}
        else:
            role, content = getattr(msg, "role", None), getattr(msg, "content", None)
            extra = {}
        if role not in _ROLES:
            raise InvalidPromptError(f"message {i} has role {role!r}; expected one of {sorted(_ROLES)}")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidPromptError(f"message {i} content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content, **extra})
    if not any(m["content"].strip() or m.get("tool_calls") for m in out if m["role"] != "system"):
        raise EmptyPromptError("the conversation has no non-empty user or assistant message")
    return out


def tokenizer_adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def _single_bos(ids: list[int], tokenizer, wants_bos: bool) -> list[int]:
    bos = tokenizer.bos_token_id
    if bos is None:
        return ids
    while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    if wants_bos and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return ids


def _rendered_text(tokenizer, prompt: PromptLike, chat: bool | None) -> tuple[str, bool]:
    """The prompt as text before tokenization, and whether the tokenizer should add special tokens."""
    if isinstance(prompt, bytes):
        raise InvalidPromptError("prompt must be str or a list of messages, not bytes; decode it first")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise EmptyPromptError("the prompt is empty")
        use_chat = has_template if chat is None else chat
        if use_chat and not has_template:
            raise InvalidPromptError("chat=True but this tokenizer has no chat template")
        if not use_chat:
            return prompt, True
        messages = [{"role": "user", "content": prompt}]
    else:
        if chat is False:
            raise InvalidPromptError("chat=False needs a string prompt, not messages")
        if not has_template:
            raise InvalidPromptError("this tokenizer has no chat template; pass a plain string prompt")
        messages = normalize_messages(prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False


def render_prompt(tokenizer, prompt: PromptLike, *, chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``; see the module docstring for the rules."""
    text, add_special = _rendered_text(tokenizer, prompt, chat)
    ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    return _single_bos(list(ids), tokenizer, tokenizer_adds_bos(tokenizer))


def last_paragraph(text: str) -> str:
    """The text after the last blank line (the whole text when it has none), stripped."""
    paragraphs = [p for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    return paragraphs[-1].strip() if paragraphs else ""


def default_question(prompt: PromptLike) -> str:
    """Where the question sits by convention: the last paragraph of the last user message."""
    if isinstance(prompt, str):
        return last_paragraph(prompt)
    users = [m for m in normalize_messages(prompt) if m["role"] == "user" and m["content"].strip()]
    return last_paragraph(users[-1]["content"]) if users else ""


def question_tail_tokens(tokenizer, prompt: PromptLike, *, chat: bool | None = None, question: str | None = None) -> int | None:
    """How many trailing prompt tokens the question and everything after it take.

    ``question``: the question's text as it appears in the prompt (its last occurrence is
    used); by default :func:`default_question`. Counts the chat template's tail too (end of
    turn, assistant header). None when the question text is not found in the rendered prompt.
    """
    text, add_special = _rendered_text(tokenizer, prompt, chat)
    needle = (question if question is not None else default_question(prompt)).strip()
    start = text.rfind(needle) if needle else -1
    if start < 0:
        return None
    encoded = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    # The first token that reaches into the question; counted from the end, so a BOS
    # adjusted at the front by render_prompt does not shift it.
    for index, (_, end) in enumerate(offsets):
        if end > start:
            return len(offsets) - index
    return None

"""One exception type per kind of bad input, all under :class:`SnapKVRagError`.

Each subclasses the matching builtin (``ValueError``, ``FileNotFoundError``) so callers
that already catch those keep working.
"""

from __future__ import annotations


class SnapKVRagError(Exception):
    """Base class of every error this toolkit raises on purpose.

    ``param``: the argument at fault when there is one (``"temperature"``, ``"tools"``), so a
    server can name it without reading the message.
    """

    param: str | None = None

    def __init__(self, *args: object, param: str | None = None):
        super().__init__(*args)
        if param is not None:
            self.param = param


class ModelNotFoundError(SnapKVRagError, FileNotFoundError):
    """The model path, GGUF file or hub id could not be resolved."""


class InvalidDeviceError(SnapKVRagError, ValueError):
    """The device or dtype is unknown, or not available on this machine or torch build."""


class InvalidPromptError(SnapKVRagError, ValueError):
    """The prompt is not a string or a well-formed list of chat messages (or, for ``score``,
    the continuation is not a non-empty list of token ids in the vocabulary)."""


class EmptyPromptError(InvalidPromptError):
    """The prompt (or every message of it) is empty or whitespace."""


class PromptTooLongError(SnapKVRagError, ValueError):
    """Prompt plus requested new tokens do not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int, rolled_positions: int | None = None):
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length
        if rolled_positions is None:
            needed = prompt_tokens
            remedy = (
                "shorten the prompt, lower max_new_tokens, or read it with a sparse policy (e.g. compression='default'), "
                "which reads a prompt past the window a chunk at a time (rolling=)"
            )
        else:
            needed = rolled_positions
            remedy = f"read through rolling=, it takes up to {rolled_positions} positions (budget + rolling + window): lower them or max_new_tokens"
        super().__init__(
            f"prompt has {prompt_tokens} tokens and max_new_tokens={max_new_tokens}, "
            f"together {needed + max_new_tokens} positions, but the model's context is "
            f"{context_length} tokens; {remedy}"
        )


class InvalidGenerationParameterError(SnapKVRagError, ValueError):
    """A generation parameter (max_new_tokens, temperature, top_p, stop, seed) is invalid."""


class InvalidCompressionError(SnapKVRagError, ValueError):
    """A compression policy or its specification string is invalid."""

    param = "compression"


class LessTrainingError(SnapKVRagError, ValueError):
    """LESS training cannot run as asked: bad settings, too little text, a work dir or kernel file that does not fit."""


class AgentMemoryError(SnapKVRagError, ValueError):
    """Agent memory misuse: a bad thread id, an invalid setting, a summariser that returned no text."""


class HistoryTooLongError(PromptTooLongError):
    """The parts of a thread the memory must keep (system messages, the latest turn) exceed the budget.

    The memory never truncates a single message, so the caller must raise the budget (a longer
    context, fewer ``max_new_tokens``, a smaller reserve) or send a shorter latest turn.
    """

    def __init__(self, tokens: int, budget: int, detail: str = ""):
        self.prompt_tokens = tokens
        self.budget = budget
        self.max_new_tokens = None  # type: ignore[assignment]  # not a context-window overflow
        self.context_length = None  # type: ignore[assignment]
        Exception.__init__(
            self,
            f"the thread's system messages and latest turn alone render to {tokens} tokens, over the "
            f"budget of {budget}{detail}; the memory never cuts a message: use a model with a longer "
            "context, lower max_new_tokens or the reserve, or send a shorter latest turn",
        )


class StructuredOutputError(SnapKVRagError, ValueError):
    """Tools, tool_choice or response_format are malformed, a schema cannot be compiled into a
    grammar, or the output does not parse or validate (for example when ``max_new_tokens``
    ends generation inside a tool call). Unparsed JSON is never returned as a success."""


class EvalInputError(SnapKVRagError, ValueError):
    """An evaluation or training command got unusable input (a missing corpus, a bad questions file, a bad count)."""

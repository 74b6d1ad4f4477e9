"""Tool calling and structured output: tool specs, calls parsed and streamed (``calls.py``), the
grammar that constrains decoding (``constraints.py``) and the opt-in call gate (``call_gate.py``).

The names of ``calls.py`` are exported here, as the module ``snapkv_rag.tools`` did before it
became this package.
"""

from .calls import (
    CALL_CLOSE,
    CALL_OPEN,
    DEFAULT_MAX_TOOL_CALLS,
    MARKER,
    TEXT,
    OutputSpec,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolSpec,
    build_output_spec,
    call_key,
    call_prefix,
    check_schema,
    complete_calls_text,
    dump_json,
    format_call,
    new_call_id,
    parse_json_output,
    parse_tool_calls,
    split_calls,
    validate_instance,
)

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "DEFAULT_MAX_TOOL_CALLS",
    "MARKER",
    "TEXT",
    "OutputSpec",
    "ParsedOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolSpec",
    "build_output_spec",
    "call_key",
    "call_prefix",
    "check_schema",
    "complete_calls_text",
    "dump_json",
    "format_call",
    "new_call_id",
    "parse_json_output",
    "parse_tool_calls",
    "split_calls",
    "validate_instance",
]

"""langchain-tests standard unit suite for ChatSnapKV (construction only: nothing is loaded)."""

from __future__ import annotations

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_snapkv import ChatSnapKV


class TestChatSnapKVUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSnapKV]:
        return ChatSnapKV

    @property
    def chat_model_params(self) -> dict:
        return {"model": "default"}  # the engine loads lazily, on the first call

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

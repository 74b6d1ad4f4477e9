"""What ChatSnapKV declares to the langchain-tests standard suites (unit and integration alike)."""

from __future__ import annotations

from langchain_snapkv import ChatSnapKV


class SnapKVChatCapabilities:
    """Mixin for the standard test classes: the model class and the features it supports."""

    @property
    def chat_model_class(self) -> type[ChatSnapKV]:
        return ChatSnapKV

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

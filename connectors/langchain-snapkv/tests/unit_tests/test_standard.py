"""langchain-tests standard unit suite for ChatSnapKV (construction only: nothing is loaded)."""

from __future__ import annotations

from langchain_tests.unit_tests import ChatModelUnitTests

from tests.capabilities import SnapKVChatCapabilities


class TestChatSnapKVUnit(SnapKVChatCapabilities, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"model": "default"}  # the engine loads lazily, on the first call

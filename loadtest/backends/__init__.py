"""Targets the load generator can drive: pdserve's gRPC gateway and OpenAI-compatible HTTP."""

from __future__ import annotations

from loadtest.backends.base import Backend, RequestOutput, SendOptions

BACKEND_NAMES = ("pdserve", "openai", "openai-chat")

__all__ = ["BACKEND_NAMES", "Backend", "RequestOutput", "SendOptions"]

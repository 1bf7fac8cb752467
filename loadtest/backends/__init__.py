"""Targets the load generator can drive: pdserve's gRPC gateway, OpenAI-compatible HTTP and
KServe v2 / Triton gRPC."""

from __future__ import annotations

from loadtest.backends.base import Backend, RequestOutput, SendOptions

BACKEND_NAMES = ("pdserve", "openai", "openai-chat", "kserve")

__all__ = ["BACKEND_NAMES", "Backend", "RequestOutput", "SendOptions"]

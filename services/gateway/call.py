"""The client's call, as the request path reads it."""

from __future__ import annotations

from typing import Any, Protocol


class Call(Protocol):
    """grpc's ServicerContext, or a front door's stand-in for it (the HTTP API's)."""

    def invocation_metadata(self) -> Any:
        """``(key, value)`` pairs; ``authorization`` names the tenant when keys are on."""

    def time_remaining(self) -> float | None:
        """Seconds to the caller's deadline; None without one."""

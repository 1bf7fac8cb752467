"""The Redis client every pdserve process uses (registry and prefix index).

Redis is advisory here: when it is down or hung, a call must fail within a second or two so
that routing falls back to load only and workers carry on, never wait out a TCP timeout.
The client reconnects by itself on the next call once Redis is back.
"""

from __future__ import annotations

from typing import Any

CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 2.0


def connect(url: str) -> Any:
    """A ``redis.asyncio.Redis`` for ``url`` with short timeouts and no retries of its own."""
    import redis.asyncio

    return redis.asyncio.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        retry_on_timeout=False,
    )

"""Client channels and deadline propagation."""

from __future__ import annotations

from typing import Protocol

import grpc

from common.rpc.options import CHANNEL_OPTIONS
from common.rpc.tls import TlsConfig


def create_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None
) -> grpc.aio.Channel:
    """A channel with pdserve's options; TLS with ``credentials`` (common/rpc/tls.py)."""
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


class HasDeadline(Protocol):
    def time_remaining(self) -> float | None: ...


def remaining_timeout(context: HasDeadline, default_s: float | None = None) -> float | None:
    """The caller's time left, to pass downstream as the next call's timeout."""
    left = context.time_remaining()
    if left is None:
        return default_s
    return max(0.0, left)


class ChannelPool:
    """One channel per target, created on first use and closed together; every one over
    mutual TLS when ``tls`` is set (the internal hops of a ``--mtls`` stack)."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._credentials = tls.channel_credentials() if tls is not None else None

    def get(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = create_channel(target, self._credentials)
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

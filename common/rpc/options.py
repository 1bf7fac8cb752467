"""gRPC channel and server options, stated once.

KV streams carry chunks of up to 4 MiB plus framing, over gRPC's default 4 MiB limit, so
both directions allow 16 MiB. ``grpc.so_reuseport`` is off: with it on, a second server on
a busy port binds silently and steals half the traffic.

Channels reconnect at most a second apart. gRPC's default backoff grows to two minutes, and
while it waits every call fails at once with "failed to connect": a worker restarted on its
address (``pdserve restart``, a rolling restart) would be back, listed in the registry and
routed to, yet unreachable from a gateway that had tried it a few times while it was down.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
KV_CHUNK_BYTES = 4 * 1024 * 1024

_COMMON: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    *_COMMON,
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_connection_idle_ms", 10 * 60_000),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *_COMMON,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

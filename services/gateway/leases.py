"""Every lease the gateway hands back, from one place: a prefill's pinned KV that no decode
worker will pull (the client left, the request ended at its first token, the decode stream
broke before the worker took it), and the lease a failed prefill call may have pinned under
the id the gateway chose for it. Releases run in the background and are retried while the
producer does not answer (common/kv/release.py); ``close`` gives them a moment at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from common.kv.release import RELEASE_RETRY_S, release_lease
from common.rpc.channels import ChannelPool
from pdserve.common.v1 import common_pb2

CLOSE_GRACE_S = 2.0  # what close() waits for each release still running


class LeaseReturns:
    def __init__(self, channels: ChannelPool) -> None:
        self.channels = channels
        self._background: set[asyncio.Task[Any]] = set()

    def handle(self, handle: common_pb2.KvHandle) -> None:
        """Releases a prefill's KV handle nobody will pull (until its lease would expire)."""
        self._start(
            release_lease(
                self.channels.get(handle.producer_address),
                handle.lease_id,
                retry_for_s=RELEASE_RETRY_S,
                expiry_unix_ms=handle.lease_expiry_unix_ms,
            )
        )

    def lease_id(self, address: str, lease_id: str) -> None:
        """Releases the lease a prefill call to ``address`` may have pinned under
        ``lease_id`` (the gateway's own id): freed, or tombstoned if it does not exist yet,
        once the worker answers."""
        self._start(
            release_lease(self.channels.get(address), lease_id, retry_for_s=RELEASE_RETRY_S)
        )

    def _start(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            await asyncio.wait([task], timeout=CLOSE_GRACE_S)

"""Leases on exported KV: a producer keeps a request's blocks pinned until the consumer
releases the lease or it expires.

Lifetime contract: ``create`` is called with the request's blocks already held by the
engine (a prefill-only request); ``release``/expiry call ``on_release(request_id)`` exactly
once, which must free those blocks. All methods run on the event loop thread.

A caller may choose the lease id up front. Then a ``release`` that arrives before the lease
exists (the caller gave up while the prefill was finishing) leaves a tombstone, and
``create`` under that id releases at once instead of pinning blocks nobody will pull.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from common.errors import AlreadyExistsError, NotFoundError

log = logging.getLogger(__name__)

_MAX_TOMBSTONES = 100_000  # bounds memory if a peer releases ids that never come


@dataclass
class Lease:
    lease_id: str
    request_id: str
    expiry_unix_ms: int
    num_tokens: int
    block_hashes: list[int]
    data: torch.Tensor  # [n, L, 2, S, Hkv, D] in the wire layout


class LeaseTable:
    def __init__(self, ttl_s: float, on_release: Callable[[str], Awaitable[object]]) -> None:
        self.ttl_s = ttl_s
        self._on_release = on_release
        self._leases: dict[str, Lease] = {}
        self._tombstones: dict[str, float] = {}  # lease id -> unix time it may be forgotten
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    async def create(
        self,
        request_id: str,
        num_tokens: int,
        block_hashes: list[int],
        data: torch.Tensor,
        lease_id: str = "",
    ) -> Lease | None:
        """A new lease, or None when its id was already released (the blocks are freed)."""
        if lease_id and self._tombstones.pop(lease_id, None) is not None:
            await self._on_release(request_id)
            return None
        if lease_id in self._leases:
            raise AlreadyExistsError(f"lease {lease_id!r} already exists")
        lease = Lease(
            lease_id=lease_id or f"lease-{secrets.token_hex(8)}",
            request_id=request_id,
            expiry_unix_ms=int((time.time() + self.ttl_s) * 1000),
            num_tokens=num_tokens,
            block_hashes=block_hashes,
            data=data,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str, request_id: str | None = None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.expiry_unix_ms < time.time() * 1000:
            raise NotFoundError(f"no live lease {lease_id!r} (unknown, released or expired)")
        if request_id is not None and lease.request_id != request_id:
            raise NotFoundError(f"lease {lease_id!r} does not belong to request {request_id!r}")
        return lease

    async def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            if len(self._tombstones) < _MAX_TOMBSTONES:
                self._tombstones[lease_id] = time.time() + self.ttl_s
            return False
        await self._on_release(lease.request_id)
        return True

    async def release_all(self) -> None:
        for lease_id in list(self._leases):
            await self.release(lease_id)

    async def expire(self) -> int:
        now_ms = time.time() * 1000
        self._tombstones = {k: t for k, t in self._tombstones.items() if t * 1000 > now_ms}
        expired = [lid for lid, lease in self._leases.items() if lease.expiry_unix_ms < now_ms]
        for lease_id in expired:
            log.info("lease %s expired unreleased", lease_id)
            await self.release(lease_id)
        self.num_expired += len(expired)
        return len(expired)

    async def run_expiry(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.expire()

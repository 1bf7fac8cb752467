"""Leases on exported KV: release, expiry, and a release that arrives before the lease."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from common.errors import AlreadyExistsError, NotFoundError
from common.kv.leases import LeaseTable

DATA = torch.zeros(1, 2, 2, 16, 1, 4)


def table(ttl_s: float = 30.0) -> tuple[LeaseTable, list[str]]:
    freed: list[str] = []

    async def on_release(request_id: str) -> None:
        freed.append(request_id)

    return LeaseTable(ttl_s, on_release), freed


def test_release_frees_once_and_is_idempotent() -> None:
    async def body() -> None:
        leases, freed = table()
        lease = await leases.create("r1", 10, [], DATA)
        assert lease is not None and leases.get(lease.lease_id, "r1") is lease
        with pytest.raises(NotFoundError):
            leases.get(lease.lease_id, "someone-else")
        assert await leases.release(lease.lease_id)
        assert not await leases.release(lease.lease_id)
        assert freed == ["r1"]
        with pytest.raises(NotFoundError):
            leases.get(lease.lease_id)

    asyncio.run(body())


def test_unreleased_leases_expire() -> None:
    async def body() -> None:
        leases, freed = table(ttl_s=0.05)
        await leases.create("r1", 10, [], DATA)
        assert await leases.expire() == 0
        time.sleep(0.06)
        assert await leases.expire() == 1
        assert freed == ["r1"] and len(leases) == 0

    asyncio.run(body())


def test_a_release_before_the_lease_exists_frees_it_on_creation() -> None:
    async def body() -> None:
        leases, freed = table()
        assert not await leases.release("lease-chosen")  # the caller gave up first
        assert await leases.create("r1", 10, [], DATA, lease_id="lease-chosen") is None
        assert freed == ["r1"] and len(leases) == 0
        # The tombstone is used up: the id can be leased again.
        again = await leases.create("r2", 10, [], DATA, lease_id="lease-chosen")
        assert again is not None and again.lease_id == "lease-chosen"
        with pytest.raises(AlreadyExistsError):
            await leases.create("r3", 10, [], DATA, lease_id="lease-chosen")

    asyncio.run(body())

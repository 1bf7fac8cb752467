"""The prefix-cache index in Redis: which worker (or the block store) holds which block.

Workers publish ``BlockStored`` for blocks they computed or imported and ``BlockRemoved``
for blocks they evicted; entries also carry a TTL so a dead worker's blocks fade away.
The gateway looks up a prompt's chained block hashes in one pipelined round trip per
batch, stopping at the first block nobody holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.index import keys

LOOKUP_BATCH = 32
PUBLISH_BATCH = 1024  # blocks per pipeline when (re)publishing


class PrefixIndex:
    def __init__(self, redis: Any, model: str, ttl_s: int = 600) -> None:
        self.redis = redis
        self.model = model
        self.ttl_s = ttl_s

    async def publish(self, location: str, block_hashes: Sequence[int], tier: str) -> None:
        for start in range(0, len(block_hashes), PUBLISH_BATCH):
            pipe = self.redis.pipeline(transaction=False)
            for h in block_hashes[start : start + PUBLISH_BATCH]:
                key = keys.block(self.model, h)
                pipe.hset(key, location, tier)
                pipe.expire(key, self.ttl_s)
            await pipe.execute()

    async def remove(self, location: str, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        pipe = self.redis.pipeline(transaction=False)
        for h in block_hashes:
            pipe.hdel(keys.block(self.model, h), location)
        await pipe.execute()

    async def lookup(self, block_hashes: Sequence[int]) -> list[dict[str, str]]:
        """Locations of each block of the longest prefix held anywhere."""
        found: list[dict[str, str]] = []
        for start in range(0, len(block_hashes), LOOKUP_BATCH):
            pipe = self.redis.pipeline(transaction=False)
            for h in block_hashes[start : start + LOOKUP_BATCH]:
                pipe.hgetall(keys.block(self.model, h))
            for entry in await pipe.execute():
                if not entry:
                    return found
                found.append({_text(k): _text(v) for k, v in entry.items()})
        return found


def prefix_overlap(locations: list[dict[str, str]]) -> dict[str, int]:
    """Per location: how many leading blocks of the prompt it holds without a gap."""
    overlap: dict[str, int] = {}
    alive: set[str] | None = None
    for i, entry in enumerate(locations):
        holders = set(entry) if alive is None else alive & set(entry)
        for location in holders:
            overlap[location] = i + 1
        alive = holders
        if not alive:
            break
    return overlap


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

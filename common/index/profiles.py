"""Worker profiles in Redis: one JSON string per ``ProfileKey`` (model, weight format,
threads, device), and per model a set of its profiles' slugs, so that the planner lists a
model's profiles without scanning the keyspace (keys in common/index/keys.py).

Workers of one key that start together measure once: the first claims the key
(``claim``), the others wait for its profile.

A profile outlives its workers (the next worker with the same key reuses it instead of
measuring), but not forever: both keys expire ``ttl_s`` after the last put, which renews
them. A slug whose profile expired is pruned from the set when the set is read.
"""

from __future__ import annotations

import logging
from typing import Any

from common.index import keys
from common.planner.profile import ProfileKey, WorkerProfile

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 30 * 24 * 3600


class ProfileStore:
    def __init__(self, redis: Any, ttl_s: float = DEFAULT_TTL_S) -> None:
        """``redis``: a ``redis.asyncio.Redis`` (common/index/redis_client.py connect())."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.redis = redis
        self.ttl_ms = round(ttl_s * 1000)

    async def put(self, profile: WorkerProfile) -> None:
        """Writes ``profile`` (replacing the one of its key) and renews both TTLs."""
        model, slug = profile.key.model, profile.key.slug()
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(keys.profile(model, slug), profile.to_json(), px=self.ttl_ms)
        pipe.sadd(keys.profiles(model), slug)
        pipe.pexpire(keys.profiles(model), self.ttl_ms)
        await pipe.execute()

    async def get(self, key: ProfileKey) -> WorkerProfile | None:
        """The profile of ``key``; None when there is none, or what is stored cannot be read
        (another format, or another key under the same slug)."""
        raw = await self.redis.get(keys.profile(key.model, key.slug()))
        profile = _parse(raw, key.slug()) if raw is not None else None
        return profile if profile is not None and profile.key == key else None

    async def list(self, model: str) -> list[WorkerProfile]:
        """Every readable profile of ``model``, by slug."""
        slugs = sorted(_text(s) for s in await self.redis.smembers(keys.profiles(model)))
        if not slugs:
            return []
        raws = await self.redis.mget([keys.profile(model, slug) for slug in slugs])
        expired = [slug for slug, raw in zip(slugs, raws, strict=True) if raw is None]
        if expired:
            await self.redis.srem(keys.profiles(model), *expired)
        parsed = (_parse(raw, slug) for slug, raw in zip(slugs, raws, strict=True) if raw)
        return [p for p in parsed if p is not None]


    async def claim(self, key: ProfileKey, owner: str, ttl_s: float) -> bool:
        """True if ``owner`` may measure ``key`` now: nobody else claimed it within
        ``ttl_s``. Workers of one key starting together measure once, not each at the same
        time on shared cores (which would make every measurement slow)."""
        claimed = await self.redis.set(
            keys.profile_lock(key.model, key.slug()), owner, nx=True, px=round(ttl_s * 1000)
        )
        return bool(claimed)

    async def release(self, key: ProfileKey) -> None:
        await self.redis.delete(keys.profile_lock(key.model, key.slug()))


def _parse(raw: bytes | str, slug: str) -> WorkerProfile | None:
    try:
        return WorkerProfile.from_json(_text(raw))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("profile %s in Redis cannot be read (%s); it will be measured again", slug, exc)
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

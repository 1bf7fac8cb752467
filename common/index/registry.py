"""The worker registry in Redis: each process heartbeats its address and load under a TTL."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from common.index import keys


@dataclass
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | both | blockstore | gateway | planner
    address: str
    model: str = ""
    num_kv_blocks_total: int = 0
    num_kv_blocks_free: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache_hit_rate: float = 0.0
    # Most tokens a request may span on this worker (its KV pool bounds it too); 0 = unknown.
    max_model_len: int = 0
    heartbeat_unix_ms: int = 0
    pid: int = 0  # on the process's own host; 0 = unknown
    # Asked to stop and draining: admits nothing new, so routers skip it.
    draining: bool = False
    # Tokens queued or mid-computation on the worker: what a new prompt waits behind.
    num_pending_tokens: int = 0
    # The weight format's KV identity ("" = float weights): KV moves only between workers
    # with the same one, and the gateway hashes a prompt with it (common/kv/hashing.py).
    weights: str = ""
    # Its Prometheus endpoint's port on the address's host; 0 = none (the planner scrapes it).
    metrics_port: int = 0
    # When an engine worker took its current role (unix ms; pdserve role, the planner).
    role_since_unix_ms: int = 0

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    def to_redis(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> WorkerInfo:
        text = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in text:
                continue
            kind = f.type if isinstance(f.type, type) else _PARSERS[str(f.type)]
            values[f.name] = _parse_bool(text[f.name]) if kind is bool else kind(text[f.name])
        return cls(**values)


class WorkerRegistry:
    def __init__(self, redis: Any, ttl_s: float = 6.0) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def heartbeat(self, info: WorkerInfo) -> bool:
        """Writes the entry and renews its TTL. True when Redis did not hold the entry before
        (the first heartbeat, one after the entry expired, or a Redis that restarted empty):
        then whatever else this process keeps in Redis is likely gone too and should be
        written again (``WorkerRuntime`` republishes its blocks to the prefix index)."""
        info.heartbeat_unix_ms = int(time.time() * 1000)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.worker(info.worker_id), mapping=info.to_redis())
        pipe.pexpire(keys.worker(info.worker_id), int(self.ttl_s * 1000))
        pipe.sadd(keys.workers(), info.worker_id)
        added, _, _ = await pipe.execute()
        return bool(added)  # HSET counts the fields it created: all of them on a new key

    async def deregister(self, worker_id: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(keys.worker(worker_id))
        pipe.srem(keys.workers(), worker_id)
        await pipe.execute()

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        ids = sorted(_text(i) for i in await self.redis.smembers(keys.workers()))
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(keys.worker(worker_id))
        raw = await pipe.execute()
        alive, dead = [], []
        for worker_id, entry in zip(ids, raw, strict=True):
            if entry:
                alive.append(WorkerInfo.from_redis(entry))
            else:
                dead.append(worker_id)
        if dead:
            await self.redis.srem(keys.workers(), *dead)
        return [w for w in alive if role is None or w.role == role]


_PARSERS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _parse_bool(text: str) -> bool:
    return text not in ("0", "False", "")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""The gateway's view of live workers: the Redis registry, re-read at most every refresh_s."""

from __future__ import annotations

import time

from common.errors import UnavailableError
from common.index.registry import WorkerInfo, WorkerRegistry
from common.telemetry.metrics import RedisHealth


class WorkerDirectory:
    def __init__(
        self, registry: WorkerRegistry, refresh_s: float, redis_health: RedisHealth | None = None
    ) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self.redis_health = redis_health
        self._workers: list[WorkerInfo] = []
        self._read_at = 0.0

    async def workers(self) -> list[WorkerInfo]:
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            try:
                self._workers = await self.registry.list()
            except Exception as exc:
                if self.redis_health is not None:
                    self.redis_health.failed("registry_read")
                raise UnavailableError(
                    f"the worker registry (Redis) cannot be read: {exc}"
                ) from exc
            self._read_at = now
            if self.redis_health is not None:
                self.redis_health.ok()
        return self._workers

    async def by_role(self, role: str, model: str) -> list[WorkerInfo]:
        """The workers that take new requests of ``model`` in ``role`` (not draining)."""
        return [
            w
            for w in await self.workers()
            if w.role == role and w.model == model and not w.draining
        ]

    def forget(self, worker_id: str) -> None:
        """Drops a worker that failed a call until the registry says otherwise."""
        self._workers = [w for w in self._workers if w.worker_id != worker_id]

"""The gateway's view of live workers: the Redis registry, re-read at most every refresh_s.

A worker is in the registry while it heartbeats (its entry's TTL is a few heartbeats), so
one that dies or hangs leaves the routing set within seconds. When Redis cannot be read the
directory keeps serving the last list it read (routing goes on by load; the circuit
breakers keep the gateway away from workers that died meanwhile) and asks Redis again at
most every ``IndexHealth.retry_s``. Right after Redis comes back it may be empty or partly
filled until every worker's next heartbeat, so for ``recovery_grace_s`` the workers known
before the outage stay listed next to those read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.errors import UnavailableError
from common.index.registry import WorkerInfo, WorkerRegistry
from common.planner.types import BOTH, DECODE, PREFILL
from services.gateway.health import IndexHealth

RECOVERY_GRACE_S = 6.0  # a registry TTL: every live worker has heartbeated by then
FACE_ROLES = {PREFILL: (PREFILL, BOTH), DECODE: (DECODE, BOTH)}  # a call -> roles taking it


class WorkerDirectory:
    def __init__(
        self,
        registry: WorkerRegistry,
        refresh_s: float,
        health: IndexHealth | None = None,
        recovery_grace_s: float = RECOVERY_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.registry = registry
        self.refresh_s = refresh_s
        self.health = health
        self.recovery_grace_s = recovery_grace_s
        self._workers: list[WorkerInfo] = []
        self._read_at = 0.0
        self._ever_read = False
        self._outage = False  # the last read failed
        self._recovered_at = -1e9  # monotonic time the first read after an outage succeeded

    async def workers(self) -> list[WorkerInfo]:
        now = self.clock()
        if now - self._read_at < self.refresh_s:
            return self._workers
        if self._ever_read and self.health is not None and not self.health.should_try():
            return self._workers  # Redis is down: not retried on every request
        try:
            read = await self.refresh()
        except Exception as exc:
            if not self._ever_read:
                raise UnavailableError(
                    f"the worker registry (Redis) cannot be read: {exc}"
                ) from exc
            return self._workers
        return read

    async def refresh(self) -> list[WorkerInfo]:
        """Reads the registry now; raises when Redis cannot be read (noted in health)."""
        now = self.clock()
        try:
            read = await self.registry.list()
        except Exception as exc:
            self._read_at = now
            self._outage = True
            if self.health is not None:
                self.health.failed("registry_read", exc)
            raise
        if self.health is not None:
            self.health.ok()
        if self._outage:
            self._outage = False
            self._recovered_at = now
        if now - self._recovered_at < self.recovery_grace_s:
            ids = {w.worker_id for w in read}
            read = read + [w for w in self._workers if w.worker_id not in ids]
        self._workers = read
        self._read_at = now
        self._ever_read = True
        return read

    def known(self) -> list[WorkerInfo]:
        """The last list read, without asking Redis."""
        return self._workers

    async def by_role(self, role: str, model: str) -> list[WorkerInfo]:
        """The workers that take new ``role`` calls (prefill, decode) for ``model``: those
        in that role or in both, not draining."""
        return [
            w
            for w in await self.workers()
            if w.role in FACE_ROLES[role] and w.model == model and not w.draining
        ]

    def forget(self, worker_id: str) -> None:
        """Drops a worker that failed a call until the registry says otherwise."""
        self._workers = [w for w in self._workers if w.worker_id != worker_id]

"""Applies a split to engine workers the planner reaches directly: their roles change in
place (pdserve.worker.v1.WorkerService.SetRole), and, where the planner may start and stop
worker processes (``pdserve up``'s), their number follows the split within its bounds.

Which workers change: to turn decode workers into prefill workers, those with the fewest
streams running (the fewest to move), then the longest in their role; to turn prefill
workers into decode workers, those with the least prompt work queued. New workers are
started in the roles still missing after the flips; surplus ones are stopped (they drain)
from the role with more workers than wanted, least loaded first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from common.index.registry import WorkerInfo
from common.planner.types import DECODE, PREFILL, Split
from common.rpc.channels import ChannelPool
from common.rpc.roles import ROLE_PB
from pdserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.planner.connectors import ConnectorError
from services.planner.observe import Fleet

log = logging.getLogger(__name__)

SET_ROLE_TIMEOUT_S = 30.0
# A started worker counts in the split until it registers, or this long (a worker that
# failed to start stops counting and is started again).
START_TIMEOUT_S = 600.0


class WorkerProcesses(Protocol):
    """Starts and stops engine worker processes of one machine's stack."""

    def start(self, role: str) -> str:
        """Starts a worker in ``role``; returns its worker id (it registers once it serves)."""
        ...

    def stop(self, worker_id: str) -> None:
        """Asks the worker to stop (SIGTERM: it drains) and forgets it."""
        ...


@dataclass
class _Starting:
    role: str
    since: float


class LocalConnector:
    def __init__(
        self,
        read_fleet: Callable[[], Awaitable[Fleet]],
        channels: ChannelPool,
        processes: WorkerProcesses | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read_fleet = read_fleet
        self.channels = channels
        self.processes = processes
        self.clock = clock
        self._starting: dict[str, _Starting] = {}

    async def _fleet(self) -> list[WorkerInfo]:
        fleet = await self.read_fleet()
        live = [w for w in fleet.workers if not w.draining]
        registered = {w.worker_id for w in live}
        now = self.clock()
        self._starting = {
            worker_id: s
            for worker_id, s in self._starting.items()
            if worker_id not in registered and now - s.since < START_TIMEOUT_S
        }
        return live

    async def current(self) -> Split:
        live = await self._fleet()
        prefill = sum(w.role == PREFILL for w in live)
        prefill += sum(s.role == PREFILL for s in self._starting.values())
        decode = len(live) + len(self._starting) - prefill
        if decode < 1:
            raise ConnectorError("no decode worker is registered; the fleet cannot serve")
        return Split(prefill, decode)

    async def apply(self, split: Split) -> None:
        live = await self._fleet()
        prefill = [w for w in live if w.role == PREFILL]
        decode = [w for w in live if w.role != PREFILL]  # both counts as decode
        pending = list(self._starting.values())
        want_prefill = split.prefill - sum(s.role == PREFILL for s in pending)
        want_decode = split.decode - sum(s.role != PREFILL for s in pending)
        flips: list[tuple[WorkerInfo, str]] = []
        if len(prefill) < want_prefill and len(decode) > want_decode:
            count = min(want_prefill - len(prefill), len(decode) - want_decode)
            chosen = sorted(decode, key=lambda w: (w.num_running, w.role_since_unix_ms))[:count]
            flips += [(w, PREFILL) for w in chosen]
        elif len(decode) < want_decode and len(prefill) > want_prefill:
            count = min(want_decode - len(decode), len(prefill) - want_prefill)
            chosen = sorted(prefill, key=lambda w: (w.num_pending_tokens, w.role_since_unix_ms))
            flips += [(w, DECODE) for w in chosen[:count]]
        await asyncio.gather(*(self._set_role(w, role) for w, role in flips))
        for worker, role in flips:
            (prefill if role == DECODE else decode).remove(worker)
            (decode if role == DECODE else prefill).append(worker)
        self._scale(prefill, decode, want_prefill, want_decode)

    def _scale(
        self,
        prefill: list[WorkerInfo],
        decode: list[WorkerInfo],
        want_prefill: int,
        want_decode: int,
    ) -> None:
        missing = [(PREFILL, want_prefill - len(prefill)), (DECODE, want_decode - len(decode))]
        surplus = [(prefill, len(prefill) - want_prefill), (decode, len(decode) - want_decode)]
        if self.processes is None:
            if any(n > 0 for _, n in missing) or any(n > 0 for _, n in surplus):
                log.info("the split needs other worker counts; this planner changes roles only")
            return
        for role, count in missing:
            for _ in range(max(0, count)):
                worker_id = self.processes.start(role)
                self._starting[worker_id] = _Starting(role, self.clock())
                log.info("started worker %s in the %s role", worker_id, role)
        for workers, count in surplus:
            idle_first = sorted(workers, key=lambda w: (w.num_running, w.num_pending_tokens))
            for worker in idle_first[: max(0, count)]:
                self.processes.stop(worker.worker_id)
                log.info("stopping worker %s (%s): it drains", worker.worker_id, worker.role)

    async def _set_role(self, worker: WorkerInfo, role: str) -> None:
        stub = worker_pb2_grpc.WorkerServiceStub(self.channels.get(worker.address))
        try:
            reply = await stub.SetRole(
                worker_pb2.SetRoleRequest(role=ROLE_PB[role]), timeout=SET_ROLE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise ConnectorError(
                f"worker {worker.worker_id} refused the {role} role: {exc.code().name}: "
                f"{exc.details()}"
            ) from exc
        log.info("worker %s: %s -> %s in %.0f ms, %d streams moved on", worker.worker_id,
                 worker.role, role, reply.elapsed_ms, reply.num_streams_moved)  # fmt: skip

"""The gateway's prefill hop, beside DecodeStreamer (decode_stream.py): one Prefill call,
and failover to another prefill worker when one fails, down to the decode worker prefilling
locally when none is left. It owns the prefill's lease until the decode hop takes it:
every call is made under a lease id the gateway chose, so a call given up on (cancelled,
timed out, the worker gone mid-call) still has what it pinned released."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from common.contract.sampling import SamplingParams
from common.errors import RoleChangedError
from common.index.registry import WorkerInfo
from common.rpc.breaker import PEER_FAILURE_CODES
from common.rpc.channels import ChannelPool, remaining_timeout
from common.rpc.errors import reason_of
from common.rpc.tracing import client_span
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.gateway.call import Call
from services.gateway.decode_stream import downstream_error
from services.gateway.directory import WorkerDirectory
from services.gateway.health import WorkerBreakers
from services.gateway.leases import LeaseReturns
from services.gateway.metrics import GatewayMetrics
from services.gateway.relay import Relay
from services.gateway.routing import Route, Router

log = logging.getLogger(__name__)

PREFILL_METHOD = "/pdserve.prefill.v1.PrefillService/Prefill"

# A prefill call that ends with one of these moves on to another worker: the worker died,
# reset the connection, crashed mid-call or was stopped under it.
_FAILOVER_CODES = PEER_FAILURE_CODES | {grpc.StatusCode.CANCELLED}
# ... and after these it may have pinned KV under the lease id we chose: release it.
_MAY_HOLD_KV = _FAILOVER_CODES | {grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class RoutedRequest:
    """One Generate request once routed: what each hop after routing needs."""

    route: Route
    overlap: dict[str, int]  # prefix overlap per location, as the route was chosen on
    relay: Relay
    sampling: SamplingParams
    salt: str | None
    context: Call  # the client's call: its deadline bounds every hop


class PrefillFailed(Exception):
    """A prefill worker failed the call in a way another worker (or the decode worker) may
    not: unreachable, reset, crashed, or silent past --prefill-timeout-s."""


class PrefillCaller:
    def __init__(
        self,
        router: Router,
        directory: WorkerDirectory,
        channels: ChannelPool,
        breakers: WorkerBreakers,
        metrics: GatewayMetrics,
        leases: LeaseReturns,
        model: str,
        timeout_s: float,
    ) -> None:
        self.router = router
        self.directory = directory
        self.channels = channels
        self.breakers = breakers
        self.metrics = metrics
        self.leases = leases
        self.model = model
        self.timeout_s = timeout_s  # --prefill-timeout-s; 0: the client's deadline only

    async def prefill(self, request: RoutedRequest) -> prefill_pb2.PrefillResponse | None:
        """The prompt prefilled on ``route.prefill``; when that worker fails (unreachable,
        connection reset, crashed, or silent past --prefill-timeout-s), on the best prefill
        worker not tried yet whose breaker lets calls through, and so on. None when none is
        left: then the decode worker prefills the prompt itself (it runs the whole engine)."""
        route, relay = request.route, request.relay
        worker = route.prefill
        tried: set[str] = set()
        while worker is not None:
            try:
                return await self._call(worker, request)
            except PrefillFailed as failure:
                tried.add(worker.worker_id)
                failed = worker
                candidates = [
                    w
                    for w in self.breakers.usable(
                        await self.directory.by_role("prefill", self.model)
                    )
                    # Not the decode worker itself (role both): it prefills locally anyway.
                    if w.worker_id not in tried | {route.decode.worker_id}
                    and w.weights == route.decode.weights
                ]
                worker = (
                    self.router.best_prefill(
                        relay.request_id, len(relay.prompt), request.overlap, candidates
                    )
                    if candidates
                    else None
                )
                if worker is not None:
                    self.breakers.acquire(worker.worker_id)
                self.metrics.prefill_failovers.labels("prefill" if worker else "decode").inc()
                next_hop = (
                    f"prefill worker {worker.worker_id}"
                    if worker is not None
                    else f"decode worker {route.decode.worker_id} (local prefill)"
                )
                log.warning(
                    "request %s: prefill on %s failed (%s); moving to %s",
                    relay.request_id,
                    failed.worker_id,
                    failure,
                    next_hop,
                )
                trace.get_current_span().add_event(
                    "prefill_failover",
                    {
                        "pdserve.worker_id": failed.worker_id,
                        "pdserve.error": str(failure),
                        "pdserve.next": next_hop,
                    },
                )
        return None

    async def _call(
        self, worker: WorkerInfo, request: RoutedRequest
    ) -> prefill_pb2.PrefillResponse:
        """One prefill call. Raises PrefillFailed when the worker failed (rather than
        answered), our errors when it answered with one."""
        relay = request.relay
        # Our own lease id: if we give up on the call, we can still release what it pinned.
        lease_id = f"lease-{secrets.token_hex(8)}"
        message = prefill_pb2.PrefillRequest(
            request_id=relay.request_id,
            prompt_token_ids=relay.prompt,
            cache_salt=request.salt or "",
            lease_id=lease_id,
        )
        request.sampling.to_pb(message.sampling)
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(worker.address))
        # The tokens this call makes the worker compute, as routing estimated them.
        cached = self.router.cached_tokens(len(relay.prompt), request.overlap, worker)
        work = len(relay.prompt) - cached
        relay.queue_ms = (time.monotonic() - relay.arrival) * 1000
        hop = self.timeout_s or None
        left = remaining_timeout(request.context)
        timeout = left if hop is None else hop if left is None else min(left, hop)
        hop_bound = hop is not None and (left is None or hop < left)
        with (
            client_span(
                PREFILL_METHOD, worker.address, {"pdserve.worker_id": worker.worker_id}
            ) as span,
            self.router.calling(worker.worker_id, work),
        ):
            call = stub.Prefill(message, timeout=timeout, metadata=span.metadata)
            try:
                response: prefill_pb2.PrefillResponse = await call
            except grpc.aio.AioRpcError as exc:
                span.failed(exc)
                code = exc.code()
                if code in _MAY_HOLD_KV:
                    self.leases.lease_id(worker.address, lease_id)
                if code is grpc.StatusCode.DEADLINE_EXCEEDED and hop_bound:
                    self.breakers.failure(worker.worker_id)
                    raise PrefillFailed(f"no answer within --prefill-timeout-s {hop:g}") from exc
                if code in _FAILOVER_CODES:
                    if reason_of(exc) == RoleChangedError.reason:
                        # It answered: it prefills no more (the registry will say so soon).
                        self.directory.forget(worker.worker_id)
                    elif code in PEER_FAILURE_CODES:
                        self.breakers.failure(worker.worker_id)
                    raise PrefillFailed(f"{code.name}: {exc.details()}") from exc
                self.breakers.success(worker.worker_id)  # it answered, about the request
                raise downstream_error(exc, f"prefill worker {worker.worker_id}") from exc
            except asyncio.CancelledError:
                call.cancel()
                # Released whether or not the lease exists yet: the worker remembers.
                self.leases.lease_id(worker.address, lease_id)
                raise
            self.breakers.success(worker.worker_id)
            span.span.set_attributes(
                {
                    "pdserve.cached_tokens": response.cached_tokens,
                    "pdserve.computed_tokens": response.computed_tokens,
                }
            )
        relay.queue_ms += response.queue_ms
        return response

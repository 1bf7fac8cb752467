"""The decode phase of a request: one Decode call, or several when the stream breaks and the
request migrates (see services/gateway/migration.py), relayed as one stream."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import grpc

from common.contract.sampling import SamplingParams
from common.errors import KvLoadError, PdserveError, RoleChangedError, UnavailableError
from common.index.registry import WorkerInfo
from common.rpc.breaker import PEER_FAILURE_CODES
from common.rpc.channels import ChannelPool, remaining_timeout
from common.rpc.errors import from_rpc_error, reason_of
from common.rpc.tracing import ClientSpan
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.call import Call
from services.gateway.directory import WorkerDirectory
from services.gateway.health import WorkerBreakers
from services.gateway.leases import LeaseReturns
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import (
    STALLED,
    Migrations,
    StreamBroken,
    broken_reason,
    continuation,
)
from services.gateway.relay import Relay
from services.gateway.routing import Router

log = logging.getLogger(__name__)

DECODE_METHOD = "/pdserve.decode.v1.DecodeService/Decode"
# How long a migration waits for a decode worker to take the request (one restarting, say).
MIGRATION_WAIT_S = 10.0
_POLL_S = 0.25


@dataclass
class _Attempt:
    number: int  # 0 for the first Decode call, n for the n-th migration
    account_cached: bool  # report this call's cached tokens as the request's
    started: bool = False  # a message arrived


class DecodeStreamer:
    def __init__(
        self,
        router: Router,
        directory: WorkerDirectory,
        channels: ChannelPool,
        metrics: GatewayMetrics,
        leases: LeaseReturns,
        model: str,
        max_migrations: int,
        breakers: WorkerBreakers,
        stall_timeout_s: float = 0.0,
        first_message_extra_s: float = 0.0,
    ) -> None:
        self.breakers = breakers
        # Silence that breaks a stream (0 = none); the first message gets the extra too.
        self.stall_timeout_s = stall_timeout_s
        self.first_message_extra_s = first_message_extra_s
        self.router = router
        self.directory = directory
        self.channels = channels
        self.metrics = metrics
        self.leases = leases  # a prefill's lease goes back here when no decode took it
        self.model = model
        self.max_migrations = max_migrations

    async def stream(
        self,
        worker: WorkerInfo,
        request: decode_pb2.DecodeRequest,
        relay: Relay,
        sampling: SamplingParams,
        context: Call,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Relays the request's tokens from ``worker``, and from the workers it migrates to,
        until it finishes. ``request.kv_handle``'s lease is handed back when no decode
        worker took it."""
        handle = request.kv_handle if request.HasField("kv_handle") else None
        migrations = Migrations(self.max_migrations)
        attempt = _Attempt(0, account_cached=request.local_prefill)
        try:
            while True:
                try:
                    async for reply in self._attempt(worker, request, relay, context, attempt):
                        yield reply
                    return
                except StreamBroken as broken:
                    if handle is not None and not attempt.started:
                        self.leases.handle(handle)
                    handle = None
                    migrations.broke(worker, broken)
                    if len(relay.generated) >= sampling.max_tokens:
                        # Every token was sent; only the final message was lost.
                        ending = gateway_pb2.GenerateResponse(request_id=relay.request_id)
                        yield relay.finish(ending, common_pb2.FINISH_REASON_LENGTH)
                        return
                    target = await self._migrate(worker, broken, relay, migrations, context)
                    if target is None:
                        if relay.generated:
                            # Tokens already reached the client: close the stream's accounting.
                            ending = gateway_pb2.GenerateResponse(request_id=relay.request_id)
                            yield relay.finish(ending, common_pb2.FINISH_REASON_ERROR)
                        raise broken.error from broken
                    worker = target
                    request = continuation(request, relay.generated)
                    attempt = _Attempt(migrations.count, account_cached=False)
        finally:
            if handle is not None and not attempt.started:
                self.leases.handle(handle)

    async def _attempt(
        self,
        worker: WorkerInfo,
        request: decode_pb2.DecodeRequest,
        relay: Relay,
        context: Call,
        attempt: _Attempt,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """One Decode call. Returns once the request finished; raises StreamBroken when the
        stream broke and the request may continue elsewhere."""
        decode_id = worker.worker_id
        call: Any = None
        span = ClientSpan(
            DECODE_METHOD,
            worker.address,
            {"pdserve.worker_id": decode_id, "pdserve.migration.attempt": attempt.number},
        )
        self.router.call_started(decode_id)
        try:
            stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(worker.address))
            dispatched_ms = (time.monotonic() - relay.arrival) * 1000
            call = stub.Decode(request, timeout=remaining_timeout(context), metadata=span.metadata)
            while True:
                message = await self._next_message(call, worker, attempt)
                if message is grpc.aio.EOF:
                    break
                if not attempt.started:
                    attempt.started = True
                    self.breakers.success(decode_id)
                reply = relay.message(
                    list(message.token_ids), list(message.logprobs), message.prompt_logprobs
                )
                if message.finish_reason:
                    relay.computed_tokens = message.computed_tokens
                if attempt.account_cached and message.finish_reason:
                    relay.cached_tokens = min(
                        len(relay.prompt), message.cached_tokens + message.imported_tokens
                    )
                    relay.queue_ms = dispatched_ms + message.queue_ms
                if relay.detok.stop_string is not None:
                    yield relay.finish(reply, common_pb2.FINISH_REASON_STOP)
                    return
                if message.finish_reason:
                    yield relay.finish(reply, message.finish_reason)
                    return
                if reply.token_ids or reply.text:
                    yield reply
            raise StreamBroken(
                "stream_ended",
                PdserveError(
                    f"decode worker {decode_id}: the stream ended without a finish reason"
                ),
            )
        except grpc.aio.AioRpcError as exc:
            span.failed(exc)
            reason_given = reason_of(exc)
            kv_load_failed = reason_given == KvLoadError.reason
            # A worker that answered about the KV or its role is not failing.
            answered = reason_given in (KvLoadError.reason, RoleChangedError.reason)
            if exc.code() in PEER_FAILURE_CODES and not answered:
                self.breakers.failure(decode_id)
            if reason_given == RoleChangedError.reason:
                self.directory.forget(decode_id)  # until the registry lists its new role
            error = downstream_error(exc, f"decode worker {decode_id}")
            # A worker told to fail when it cannot load the KV (--kv-load-failure fail) has
            # answered: that is the request's outcome, not a broken stream.
            reason = None if kv_load_failed else broken_reason(exc, request.HasField("kv_handle"))
            if reason is not None:
                raise StreamBroken(reason, error) from exc
            if relay.generated and not isinstance(error, asyncio.TimeoutError):
                # Tokens already reached the client: close the stream's accounting first.
                ending = gateway_pb2.GenerateResponse(request_id=relay.request_id)
                yield relay.finish(ending, common_pb2.FINISH_REASON_ERROR)
            raise error from exc
        except BaseException as exc:
            span.failed(exc)
            raise
        finally:
            span.end()
            self.router.call_ended(decode_id)
            if call is not None and not call.done():
                call.cancel()

    async def _next_message(
        self, call: Any, worker: WorkerInfo, attempt: _Attempt
    ) -> decode_pb2.DecodeResponse | Any:
        """The call's next message (or grpc.aio.EOF). Raises StreamBroken when the worker
        stays silent past the stall timeout: a hung process keeps its connection open, so
        only silence tells."""
        if not self.stall_timeout_s:
            return await call.read()
        limit = self.stall_timeout_s + (0.0 if attempt.started else self.first_message_extra_s)
        try:
            return await asyncio.wait_for(call.read(), limit)
        except TimeoutError:
            self.breakers.failure(worker.worker_id)
            raise StreamBroken(
                STALLED,
                UnavailableError(
                    f"decode worker {worker.worker_id} sent nothing for {limit:g} s "
                    "(--decode-stall-timeout-s)"
                ),
            ) from None

    async def _migrate(
        self,
        worker: WorkerInfo,
        broken: StreamBroken,
        relay: Relay,
        migrations: Migrations,
        context: Call,
    ) -> WorkerInfo | None:
        """The decode worker that continues the request, or None when it cannot continue
        (migrations used up, the deadline passed, no worker to take it)."""
        with tracer().start_as_current_span("migrate") as span:
            span.set_attributes(
                {
                    "pdserve.migration.reason": broken.reason,
                    "pdserve.migration.number": migrations.count + 1,
                    "pdserve.migration.from_worker_id": worker.worker_id,
                    "pdserve.migration.num_generated_tokens": len(relay.generated),
                    "pdserve.migration.error": str(broken.error),
                }
            )
            target = None
            if migrations.exhausted_by(broken):
                span.set_attribute("pdserve.migration.refused", "limit")
            else:
                target = await self._pick(
                    relay.request_id, migrations, remaining_timeout(context), worker.weights
                )
                if target is None:
                    span.set_attribute("pdserve.migration.refused", "no_worker")
            if target is None:
                log.warning(
                    "request %s: decode stream from %s broke (%s) after %d tokens; cannot "
                    "migrate (%d migrations so far)",
                    relay.request_id,
                    worker.worker_id,
                    broken,
                    len(relay.generated),
                    migrations.count,
                )
                return None
            span.set_attribute("pdserve.migration.to_worker_id", target.worker_id)
        migrations.moved(broken)
        relay.num_migrations = migrations.count
        self.metrics.migrated(broken.reason)
        log.info(
            "request %s: decode stream from %s broke (%s) after %d tokens; continuing on %s",
            relay.request_id,
            worker.worker_id,
            broken.reason,
            len(relay.generated),
            target.worker_id,
        )
        return target

    async def _pick(
        self, request_id: str, migrations: Migrations, timeout_s: float | None, weights: str
    ) -> WorkerInfo | None:
        """A live decode worker the request has not broken on, waiting up to
        MIGRATION_WAIT_S (within the deadline) for one to appear; one serving the same
        weight format as the broken one when there is (another format continues the
        request, but finds none of its KV)."""
        wait_s = MIGRATION_WAIT_S if timeout_s is None else min(MIGRATION_WAIT_S, timeout_s)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                decodes = await self.directory.by_role("decode", self.model)
            except UnavailableError:
                decodes = []
            candidates = [w for w in decodes if migrations.allows(w)]
            usable = [w for w in candidates if self.breakers.allows(w.worker_id)]
            candidates = usable or candidates  # all failing: try them all the same
            candidates = [w for w in candidates if w.weights == weights] or candidates
            if candidates:
                return self.router.choose_decode(request_id, candidates)
            if time.monotonic() + _POLL_S > deadline:
                return None
            await asyncio.sleep(_POLL_S)


def downstream_error(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    """What to answer when a worker call fails. The caller's deadline, passed down, expires
    there first: that stays DEADLINE_EXCEEDED (tokens sent stand), not a server fault. A
    decode worker that could not load the KV keeps its reason (KV_LOAD_FAILED)."""
    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return asyncio.TimeoutError(f"{what}: the deadline passed")
    error = from_rpc_error(exc, what)
    if isinstance(error, UnavailableError) and reason_of(exc) == KvLoadError.reason:
        return KvLoadError(str(error))
    return error

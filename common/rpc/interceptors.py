"""Server side of telemetry, for every RPC of every pdserve process.

``TelemetryInterceptor`` reads the W3C trace context from the call's metadata, runs the
handler inside a SERVER span named ``<package.Service>/<Method>`` (OpenTelemetry RPC
conventions) and counts the call in ``pdserve:grpc_server_handled_total`` and
``pdserve:grpc_server_handling_seconds``. Health and reflection are counted, not traced
(probes would flood the traces).

Context contract: the span's context is attached for the rest of the RPC's task and never
detached. grpc.aio runs each RPC in a task of its own and tasks copy their context, so
the attachment ends with the task; a streaming handler may thus keep it across ``yield``
(a ``with`` block around a generator's ``yield`` would detach from whichever task happens
to close the generator).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram

from common.rpc.tracing import SERVER_ERROR_CODES, rpc_attributes
from common.telemetry.metrics import RPC_BUCKETS_S, metric_name
from common.telemetry.tracing import tracer

log = logging.getLogger(__name__)

UNTRACED_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter(
            metric_name("grpc_server_handled"),
            "RPCs completed on this server, by method and status code.",
            ["grpc_service", "grpc_method", "grpc_code"], registry=registry,
        )  # fmt: skip
        self.handling_seconds = Histogram(
            metric_name("grpc_server_handling_seconds"),
            "Time from an RPC's start to its status, by method.",
            ["grpc_service", "grpc_method"], registry=registry, buckets=RPC_BUCKETS_S,
        )  # fmt: skip


class _Call:
    """One RPC's span and timing; ``finish`` is idempotent (the handler's end and grpc's
    done callback both call it)."""

    def __init__(
        self, full_method: str, context: grpc.aio.ServicerContext, metrics: RpcMetrics | None
    ) -> None:
        self.service, _, self.method = full_method.lstrip("/").rpartition("/")
        self.metrics = metrics
        self.start = time.perf_counter()
        self.span: Span | None = None
        self._done = False
        if self.service not in UNTRACED_SERVICES:
            carrier = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
            parent = propagate.extract(carrier)
            self.span = tracer().start_span(
                full_method.lstrip("/"),
                context=parent,
                kind=SpanKind.SERVER,
                attributes={**rpc_attributes(full_method), "client.address": context.peer()},
            )
            otel_context.attach(trace.set_span_in_context(self.span, parent))
        context.add_done_callback(self._on_done)

    def _on_done(self, context: grpc.aio.ServicerContext) -> None:
        """grpc's callback when the call ends, however it ends (a cancelled stream may
        never resume its handler)."""
        try:
            self.finish(context.code() or grpc.StatusCode.CANCELLED)
        except Exception:
            log.exception("recording the end of %s/%s failed", self.service, self.method)

    def finish(self, code: grpc.StatusCode, details: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        if self.metrics is not None:
            self.metrics.handled.labels(self.service, self.method, code.name).inc()
            self.metrics.handling_seconds.labels(self.service, self.method).observe(
                time.perf_counter() - self.start
            )
        if self.span is not None:
            self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code in SERVER_ERROR_CODES:
                self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))
            self.span.end()

    def finish_from(self, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        try:
            self._finish_from(context, exc)
        except Exception:  # telemetry never fails a call
            log.exception("recording the end of %s/%s failed", self.service, self.method)

    def _finish_from(self, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        if exc is None:
            code = context.code() or grpc.StatusCode.OK
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            code = grpc.StatusCode.CANCELLED
        elif isinstance(exc, grpc.aio.AbortError):
            code = context.code() or grpc.StatusCode.UNKNOWN
        else:
            code = grpc.StatusCode.UNKNOWN
            if self.span is not None:
                self.span.record_exception(exc)
        self.finish(code, context.details() if exc is not None else None)


def _start(
    full_method: str, context: grpc.aio.ServicerContext, metrics: RpcMetrics | None
) -> _Call | None:
    try:
        return _Call(full_method, context, metrics)
    except Exception:  # telemetry never fails a call
        log.exception("starting telemetry for %s failed; serving it without", full_method)
        return None


class TelemetryInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        metrics = self.metrics
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method, metrics))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, method, metrics))
        if handler.unary_stream is not None:
            return handler._replace(
                unary_stream=_wrap_stream(handler.unary_stream, method, metrics)
            )
        return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, method, metrics))


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _wrap_unary(behavior: Behavior, method: str, metrics: RpcMetrics | None) -> Behavior:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = _start(method, context, metrics)
        try:
            response = await behavior(request, context)
        except BaseException as exc:
            if call is not None:
                call.finish_from(context, exc)
            raise
        if call is not None:
            call.finish_from(context, None)
        return response

    return unary


def _wrap_stream(behavior: Behavior, method: str, metrics: RpcMetrics | None) -> Behavior:
    if not inspect.isasyncgenfunction(behavior):
        # Writes with context.write() (grpc's health Watch): time it as one awaitable.
        return _wrap_unary(behavior, method, metrics)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call = _start(method, context, metrics)
        try:
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        except BaseException as exc:
            if call is not None:
                call.finish_from(context, exc)
            raise
        if call is not None:
            call.finish_from(context, None)

    return stream

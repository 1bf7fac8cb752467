"""TelemetryInterceptor and the client helpers, over a real in-process grpc.aio server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from common.rpc.interceptors import RpcMetrics, TelemetryInterceptor
from common.rpc.server import create_server
from common.rpc.tracing import ClientSpan, client_span, outgoing_metadata
from common.telemetry.logs import ContextFilter, bind_request_id
from common.telemetry.metrics import Samples
from common.telemetry.tracing import tracer

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"

SERVICE = "pdtest.v1.EchoService"


class Echo:
    """Raw-bytes handlers: what the server saw, and a child span inside each call."""

    def __init__(self) -> None:
        self.seen_metadata: list[tuple[tuple[str, str], ...]] = []
        self.log_records: list[logging.LogRecord] = []
        self.stream_started = asyncio.Event()

    async def say(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad input")
        if request == b"boom":
            raise RuntimeError("boom")
        bind_request_id("req-echo")
        with tracer().start_as_current_span("echo.inner"):
            self.seen_metadata.append(outgoing_metadata())
            record = logging.LogRecord("t", logging.INFO, __file__, 1, "hi", None, None)
            ContextFilter().filter(record)
            self.log_records.append(record)
        return request

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            tracer().start_span(f"echo.item{i}").end()
            yield b"x"
            self.stream_started.set()
        await asyncio.sleep(3600 if request == b"9" else 0)


async def _serve(echo: Echo, registry: CollectorRegistry) -> tuple[object, grpc.aio.Channel]:
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Say": grpc.unary_unary_rpc_method_handler(echo.say),
            "Stream": grpc.unary_stream_rpc_method_handler(echo.stream),
        },
    )
    server = await create_server(
        "127.0.0.1:0",
        lambda s: s.add_generic_rpc_handlers((handler,)),
        [SERVICE],
        interceptors=[TelemetryInterceptor(RpcMetrics(registry))],
    )
    return server, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")


def _by_name(spans: InMemorySpanExporter) -> dict[str, object]:
    return {s.name: s for s in spans.get_finished_spans()}


def _samples(registry: CollectorRegistry) -> Samples:
    from prometheus_client import generate_latest

    return Samples.parse(generate_latest(registry).decode())


def test_server_span_continues_the_callers_trace(spans: InMemorySpanExporter) -> None:
    echo, registry = Echo(), CollectorRegistry()

    async def run() -> bytes:
        server, channel = await _serve(echo, registry)
        try:
            say = channel.unary_unary(f"/{SERVICE}/Say")
            reply: bytes = await say(b"hello", metadata=(("traceparent", TRACEPARENT),))
            return reply
        finally:
            await channel.close()
            await server.stop(0)  # type: ignore[attr-defined]

    assert asyncio.run(run()) == b"hello"
    found = _by_name(spans)
    server_span = found[f"{SERVICE}/Say"]
    inner = found["echo.inner"]
    assert server_span.kind is SpanKind.SERVER
    assert trace.format_trace_id(server_span.context.trace_id) == CLIENT_TRACE_ID
    assert trace.format_span_id(server_span.parent.span_id) == CLIENT_SPAN_ID
    assert server_span.parent.is_remote
    assert inner.parent.span_id == server_span.context.span_id
    assert dict(server_span.attributes) | {"client.address": ""} == {
        "rpc.system": "grpc",
        "rpc.service": SERVICE,
        "rpc.method": "Say",
        "rpc.grpc.status_code": 0,
        "client.address": "",
    }
    # Downstream calls made inside carry the inner span as their parent.
    (metadata,) = echo.seen_metadata
    inner_id = trace.format_span_id(inner.context.span_id)
    assert dict(metadata)["traceparent"] == f"00-{CLIENT_TRACE_ID}-{inner_id}-01"
    # Log lines inside name the trace and the request.
    (record,) = echo.log_records
    assert record.trace_id == CLIENT_TRACE_ID and record.request_id == "req-echo"
    assert record.log_context == f" [trace_id={CLIENT_TRACE_ID} request_id=req-echo]"
    samples = _samples(registry)
    assert samples.sum("pdserve:grpc_server_handled_total", grpc_method="Say", grpc_code="OK") == 1
    assert samples.sum("pdserve:grpc_server_handling_seconds_count", grpc_method="Say") == 1


def test_a_call_without_traceparent_starts_a_new_trace(spans: InMemorySpanExporter) -> None:
    echo, registry = Echo(), CollectorRegistry()

    async def run() -> None:
        server, channel = await _serve(echo, registry)
        try:
            await channel.unary_unary(f"/{SERVICE}/Say")(b"x")
        finally:
            await channel.close()
            await server.stop(0)  # type: ignore[attr-defined]

    asyncio.run(run())
    server_span = _by_name(spans)[f"{SERVICE}/Say"]
    assert server_span.parent is None and server_span.context.trace_id != 0


def test_failed_calls_carry_their_status_code(spans: InMemorySpanExporter) -> None:
    echo, registry = Echo(), CollectorRegistry()

    async def run() -> list[grpc.StatusCode]:
        server, channel = await _serve(echo, registry)
        codes = []
        try:
            for payload in (b"bad", b"boom"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary(f"/{SERVICE}/Say")(payload)
                codes.append(info.value.code())
        finally:
            await channel.close()
            await server.stop(0)  # type: ignore[attr-defined]
        return codes

    assert asyncio.run(run()) == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN]
    bad, boom = [s for s in spans.get_finished_spans() if s.name == f"{SERVICE}/Say"]
    # The caller's mistake is the server's answer, not its failure; an exception is.
    assert (
        bad.attributes["rpc.grpc.status_code"] == 3 and bad.status.status_code is StatusCode.UNSET
    )
    assert (
        boom.attributes["rpc.grpc.status_code"] == 2 and boom.status.status_code is StatusCode.ERROR
    )
    samples = _samples(registry)
    assert samples.sum("pdserve:grpc_server_handled_total", grpc_code="INVALID_ARGUMENT") == 1
    assert samples.sum("pdserve:grpc_server_handled_total", grpc_code="UNKNOWN") == 1


def test_streams_and_cancelled_streams_end_their_span(spans: InMemorySpanExporter) -> None:
    echo, registry = Echo(), CollectorRegistry()

    async def run() -> None:
        server, channel = await _serve(echo, registry)
        stream = channel.unary_stream(f"/{SERVICE}/Stream")
        try:
            assert [m async for m in stream(b"3")] == [b"x", b"x", b"x"]
            call = stream(b"9", metadata=(("traceparent", TRACEPARENT),))
            await call.read()
            call.cancel()
            for _ in range(100):  # the server learns of the cancellation asynchronously
                if len(spans.get_finished_spans()) >= 2 + 9:
                    break
                await asyncio.sleep(0.02)
        finally:
            await channel.close()
            await server.stop(0)  # type: ignore[attr-defined]

    asyncio.run(run())
    done, cancelled = [s for s in spans.get_finished_spans() if s.name == f"{SERVICE}/Stream"]
    items = [s for s in spans.get_finished_spans() if s.name.startswith("echo.item")]
    assert {s.parent.span_id for s in items if s.context.trace_id == done.context.trace_id} == {
        done.context.span_id
    }
    assert done.attributes["rpc.grpc.status_code"] == 0
    assert cancelled.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    samples = _samples(registry)
    assert samples.sum("pdserve:grpc_server_handled_total", grpc_method="Stream") == 2
    assert samples.sum("pdserve:grpc_server_handled_total", grpc_code="CANCELLED") == 1


def test_health_checks_are_counted_not_traced(spans: InMemorySpanExporter) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    echo, registry = Echo(), CollectorRegistry()

    async def run() -> None:
        server, channel = await _serve(echo, registry)
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        finally:
            await channel.close()
            await server.stop(0)  # type: ignore[attr-defined]

    asyncio.run(run())
    assert spans.get_finished_spans() == ()
    assert _samples(registry).sum("pdserve:grpc_server_handled_total", grpc_method="Check") == 1


def test_client_spans_propagate_their_own_context(spans: InMemorySpanExporter) -> None:
    async def run() -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
        with tracer().start_as_current_span("request"):
            with client_span("/pkg.v1.Service/Unary", "host:1"):
                inner = outgoing_metadata()
            streamed = ClientSpan("/pkg.v1.Service/Stream", "host:2", {"pdserve.worker_id": "w"})
            streamed.failed(asyncio.CancelledError())
            streamed.end()
            return inner, streamed.metadata

    inner, streamed = asyncio.run(run())
    found = _by_name(spans)
    unary, stream, request = (
        found["pkg.v1.Service/Unary"], found["pkg.v1.Service/Stream"], found["request"]
    )  # fmt: skip
    assert unary.kind is SpanKind.CLIENT and unary.parent.span_id == request.context.span_id
    assert stream.parent.span_id == request.context.span_id
    assert dict(inner)["traceparent"].split("-")[2] == trace.format_span_id(unary.context.span_id)
    assert dict(streamed)["traceparent"].split("-")[2] == trace.format_span_id(
        stream.context.span_id
    )
    assert unary.attributes["server.address"] == "host:1"
    assert stream.attributes["pdserve.worker_id"] == "w"
    assert stream.attributes["rpc.grpc.status_code"] == 1
    assert outgoing_metadata() == ()  # outside any span

"""Client side of trace propagation: W3C ``traceparent`` into outgoing gRPC metadata.

Every call from one pdserve process to another passes ``metadata=`` from here, so one
request is one trace across the gateway, prefill, KV pull and decode. Spans follow the
OpenTelemetry RPC conventions: named ``<package.Service>/<Method>``, kind CLIENT, with
``rpc.system``, ``rpc.service``, ``rpc.method``, ``server.address`` and, once known,
``rpc.grpc.status_code``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from common.telemetry.tracing import tracer

Metadata = tuple[tuple[str, str], ...]

# Status codes that mean the call failed (the rest are the caller's answer), as the
# OpenTelemetry gRPC conventions list them for servers; clients mark every non-OK.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def outgoing_metadata(context: otel_context.Context | None = None) -> Metadata:
    """The trace headers for a call made in ``context`` (default: the current one);
    empty outside any trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items())


def rpc_attributes(full_method: str) -> dict[str, str]:
    service, _, method = full_method.lstrip("/").rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


class ClientSpan:
    """A CLIENT span for one outgoing call, not made current: for calls whose lifetime
    crosses ``yield`` (a streamed response relayed as it comes). Pass ``metadata`` with
    the call; ``end`` it once, in a ``finally``."""

    def __init__(
        self, full_method: str, target: str, attributes: Mapping[str, str | int] | None = None
    ) -> None:
        self.span: Span = tracer().start_span(
            full_method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes={
                **rpc_attributes(full_method),
                "server.address": target,
                **(attributes or {}),
            },
        )
        self.metadata = outgoing_metadata(trace.set_span_in_context(self.span))

    def failed(self, error: BaseException) -> None:
        record_error(self.span, error)

    def end(self) -> None:
        self.span.end()


@contextlib.contextmanager
def client_span(
    full_method: str, target: str, attributes: Mapping[str, str | int] | None = None
) -> Iterator[ClientSpan]:
    """A CLIENT span around an awaited call (no ``yield`` inside), current while it runs,
    so spans started inside are its children. Errors mark it and propagate."""
    call = ClientSpan(full_method, target, attributes)
    try:
        with trace.use_span(call.span, record_exception=False, set_status_on_exception=False):
            yield call
    except BaseException as exc:
        call.failed(exc)
        raise
    finally:
        call.end()


def record_error(span: Span, error: BaseException) -> None:
    """Marks ``span`` failed by ``error`` (a gRPC status keeps its code)."""
    if isinstance(error, grpc.aio.AioRpcError):
        span.set_attribute("rpc.grpc.status_code", error.code().value[0])
        span.set_status(Status(StatusCode.ERROR, f"{error.code().name}: {error.details()}"))
        return
    if isinstance(error, asyncio.CancelledError):
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
        span.set_status(Status(StatusCode.ERROR, "CANCELLED"))
        return
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

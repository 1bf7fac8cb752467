"""An OTLP/gRPC trace receiver inside the test process (opentelemetry-proto's
TraceService), so tests see exactly the spans our processes export."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.polling import settle

SERVER = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    resource: dict[str, Any]
    name: str
    kind: int  # trace_pb2.Span.SpanKind
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, Any]
    status_code: int  # trace_pb2.Status.StatusCode
    start_ns: int
    end_ns: int


def any_value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.endpoint = ""

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={kv.key: any_value(kv.value) for kv in span.attributes},
                            status_code=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> str:
        """Serves on a free loopback port; returns the endpoint for OTEL_EXPORTER_OTLP_ENDPOINT."""
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self,
        done: Callable[[list[ReceivedSpan]], bool],
        trace_id: str | None = None,
        timeout_s: float = 15.0,
    ) -> list[ReceivedSpan]:
        """The spans (of ``trace_id``) once ``done(spans)`` holds; raises on timeout."""
        spans = settle(lambda: self.spans(trace_id), done, timeout_s, every_s=0.05)
        if not done(spans):
            names = sorted(f"{s.service}:{s.name}" for s in spans)
            raise TimeoutError(f"spans not complete after {timeout_s}s: {names}")
        return spans

"""Telemetry shared by every pdserve process.

- ``tracing``: OpenTelemetry set up from the standard ``OTEL_*`` variables only.
- ``metrics``: Prometheus naming, buckets, the request-level families and the endpoint.
- ``logs``: log lines that carry the trace id and the request id.

gRPC context propagation (W3C ``traceparent`` in metadata) lives in ``common.rpc``.
"""

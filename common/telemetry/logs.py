"""Log lines that name their trace and request.

Every record gets ``trace_id``, ``span_id`` (the current OpenTelemetry span, when its
context is valid, also with tracing off if the caller sent a ``traceparent``) and
``request_id`` (``bind_request_id``). The format appends them only when set:

    2025-01-01 12:00:00,000 INFO services.gateway.servicer [trace_id=4bf9... request_id=req-1]: ...

Binding contract: ``bind_request_id`` sets a context variable without resetting it. Call
it from the task that serves one request (grpc.aio runs every RPC in a task of its own,
and tasks copy their context), so the binding ends with the task.
"""

from __future__ import annotations

import contextvars
import logging
import sys

from opentelemetry import trace

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdserve_request_id", default=None
)

FORMAT = "%(asctime)s %(levelname)s %(name)s%(log_context)s: %(message)s"


def bind_request_id(request_id: str | None) -> None:
    """Names the request that this task's log lines are about (see the module docstring)."""
    _request_id.set(request_id or None)


def current_request_id() -> str | None:
    return _request_id.get()


def current_trace_id() -> str | None:
    """The current span's trace id as 32 hex digits; None outside any trace."""
    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None


class ContextFilter(logging.Filter):
    """Adds ``trace_id``, ``span_id``, ``request_id`` and ``log_context`` to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        trace_id = trace.format_trace_id(context.trace_id) if context.is_valid else ""
        span_id = trace.format_span_id(context.span_id) if context.is_valid else ""
        request_id = _request_id.get() or ""
        record.trace_id = trace_id
        record.span_id = span_id
        record.request_id = request_id
        parts = [f"trace_id={trace_id}"] if trace_id else []
        if request_id:
            parts.append(f"request_id={request_id}")
        record.log_context = f" [{' '.join(parts)}]" if parts else ""
        return True


GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
_SEND_AFTER_PEER_LEFT = "ExecuteBatchError raised in core by servicer method"


class PeerGoneFilter(logging.Filter):
    """grpc.aio's report of a stream write that failed because the client had left: a warning.

    grpc.aio ignores a failed write once it has seen the client close the call, but the close
    arrives on a task of its own: a client that cancels while a message is being sent can fail
    that send first, and grpc then logs the failure as an ERROR with a traceback that names
    nothing but the send. It is the client's cancellation, not a fault of the server (the
    call is over either way, and the servicer's cleanup runs as for any cancellation), so the
    record becomes one WARNING line that says so. Every other record passes as it is.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and str(record.msg).startswith(_SEND_AFTER_PEER_LEFT):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = (
                f"{record.getMessage()}: a stream write failed after its client went away "
                "(a cancellation racing the send)"
            )
            record.args = None
            record.exc_info = record.exc_text = None
        return True


def configure_logging(level: str) -> None:
    """The process's root logger: stderr, our format, trace and request context."""
    core = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, PeerGoneFilter) for f in core.filters):
        core.addFilter(PeerGoneFilter())
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

"""Log lines carry the trace id and the request id when there are any."""

from __future__ import annotations

import asyncio
import io
import logging
import sys

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from common.telemetry.logs import (
    FORMAT,
    GRPC_CORE_LOGGER,
    ContextFilter,
    PeerGoneFilter,
    bind_request_id,
    configure_logging,
    current_request_id,
)

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C


def _emit(message: str) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(FORMAT.replace("%(asctime)s ", "")))
    logger = logging.getLogger("pdserve.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info(message)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().strip()


def test_lines_outside_requests_are_plain() -> None:
    async def run() -> str:  # a task of its own: no request bound
        return _emit("started")

    assert asyncio.run(run()) == "INFO pdserve.test.logs: started"


def test_lines_name_the_trace_and_the_request() -> None:
    context = SpanContext(TRACE_ID, 0xB7AD6B7169203331, is_remote=True, trace_flags=TraceFlags(1))

    async def run() -> tuple[str, str]:
        with trace.use_span(NonRecordingSpan(context)):
            bind_request_id("req-7")
            inside = _emit("request finished")

        async def other_request() -> str:
            bind_request_id("req-8")
            return _emit("another")

        other = await asyncio.create_task(other_request())
        assert current_request_id() == "req-7"  # the other task's binding stayed there
        return inside, other

    inside, other = asyncio.run(run())
    assert inside == (
        "INFO pdserve.test.logs [trace_id=0af7651916cd43dd8448eb211c80319c request_id=req-7]: "
        "request finished"
    )
    assert other == "INFO pdserve.test.logs [request_id=req-8]: another"


def _grpc_core_record(message: str) -> logging.LogRecord:
    try:
        raise RuntimeError('Failed "execute_batch": (SendMessageOperation,)')
    except RuntimeError:
        exc_info = sys.exc_info()
    return logging.LogRecord(
        GRPC_CORE_LOGGER, logging.ERROR, "server.pyx.pxi", 1, message, None, exc_info
    )


def test_a_send_that_lost_the_race_with_a_cancellation_is_a_warning() -> None:
    root, core = logging.getLogger(), logging.getLogger(GRPC_CORE_LOGGER)
    saved_handlers, saved_level, saved_filters = root.handlers[:], root.level, core.filters[:]
    try:
        configure_logging("INFO")
        configure_logging("INFO")  # once per process is enough: no second filter
        assert sum(isinstance(f, PeerGoneFilter) for f in core.filters) == 1

        method = "/pdserve.kv.v1.KvTransferService/PullBlocks"
        record = _grpc_core_record(
            f"ExecuteBatchError raised in core by servicer method [{method}]"
        )
        assert core.filter(record)
        assert record.levelname == "WARNING" and record.levelno == logging.WARNING
        assert record.exc_info is None
        assert method in record.getMessage() and "client went away" in record.getMessage()

        other = _grpc_core_record("Unexpected [ValueError] raised by servicer method [/x/Y]")
        assert core.filter(other)
        assert other.levelname == "ERROR" and other.exc_info is not None
    finally:
        root.handlers[:], core.filters[:] = saved_handlers, saved_filters
        root.setLevel(saved_level)

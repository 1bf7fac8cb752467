"""Log lines carry the trace id and the request id when there are any."""

from __future__ import annotations

import asyncio
import io
import logging

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from common.telemetry.logs import FORMAT, ContextFilter, bind_request_id, current_request_id

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

"""Requests whose bytes do not parse answer INVALID_ARGUMENT, not grpc's UNKNOWN.

grpc.aio answers a request its deserializer cannot parse (truncated fields, bad varints,
groups nested past protobuf's recursion limit) with UNKNOWN, "Unexpected DecodeError". The
interceptor here swaps every handler's deserializer for one that returns a
``MalformedRequest`` instead of raising, and ends such a call with INVALID_ARGUMENT naming
the message type, through the one error mapping (common/rpc/errors.py).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from common.errors import InvalidRequestError
from common.rpc.errors import abort


class MalformedRequest:
    """What the safe deserializer returns for bytes that do not parse."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.error = InvalidRequestError(
            "request", f"the bytes do not parse as a {message_type}: {error}"
        )


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    message_type = getattr(getattr(deserializer, "__self__", None), "__name__", "request")

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, RecursionError, ValueError) as exc:
            return MalformedRequest(message_type, exc)

    return parse


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _unary_request(behavior: Behavior, streaming_response: bool) -> Behavior:
    if streaming_response:

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                await abort(context, request.error)
                return
            async for response in behavior(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await abort(context, request.error)
        return await behavior(request, context)

    return unary


def _stream_request(behavior: Behavior) -> Behavior:
    """Client streaming: a malformed message raises InvalidRequestError where the servicer
    reads it, which its ``rpc_method`` maps like any other error."""

    def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async def items() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, MalformedRequest):
                    raise request.error
                yield request

        return items()

    if inspect.isasyncgenfunction(behavior):

        async def stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async for response in behavior(checked(requests), context):
                yield response

        return stream

    async def unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(checked(requests), context)

    return unary


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        safe = handler._replace(request_deserializer=_safe(handler.request_deserializer))
        if handler.unary_unary is not None:
            return safe._replace(unary_unary=_unary_request(handler.unary_unary, False))
        if handler.unary_stream is not None:
            # An async generator streams with yield; grpc's health Watch writes with
            # context.write() and is awaited once.
            streams = inspect.isasyncgenfunction(handler.unary_stream)
            return safe._replace(unary_stream=_unary_request(handler.unary_stream, streams))
        if handler.stream_unary is not None:
            return safe._replace(stream_unary=_stream_request(handler.stream_unary))
        return safe._replace(stream_stream=_stream_request(handler.stream_stream))

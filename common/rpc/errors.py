"""The one place where errors become gRPC statuses (and statuses become errors again).

Every status carries a ``google.rpc.ErrorInfo`` with a stable ``reason`` (domain
``pdserve``), INVALID_ARGUMENT also a ``google.rpc.BadRequest`` naming the field, and a
RESOURCE_EXHAUSTED from admission a ``google.rpc.RetryInfo`` (when to try again).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from common import errors

log = logging.getLogger(__name__)

DOMAIN = "pdserve"

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.DataLossError, grpc.StatusCode.DATA_LOSS),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (asyncio.TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def to_status(exc: BaseException) -> status_pb2.Status:
    code = status_code_for(exc)
    reason = getattr(exc, "reason", None) or code.name
    message = str(exc) if code is not grpc.StatusCode.INTERNAL else f"internal error: {exc}"
    info = error_details_pb2.ErrorInfo(
        reason=reason, domain=DOMAIN, metadata=getattr(exc, "metadata", None) or {}
    )
    details: list[Message] = [info]
    retry_after_ms = getattr(exc, "retry_after_ms", None)
    if retry_after_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(retry_after_ms))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    if isinstance(exc, errors.InvalidRequestError):
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=exc.field, description=message
                    )
                ]
            )
        )
    packed = []
    for detail in details:
        holder = any_pb2.Any()
        holder.Pack(detail)
        packed.append(holder)
    return status_pb2.Status(code=code.value[0], message=message, details=packed)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends the call with the status for ``exc`` (raises grpc's AbortError)."""
    await context.abort_with_status(rpc_status.to_status(to_status(exc)))


def retry_delay_ms(error: grpc.RpcError) -> int | None:
    """The google.rpc.RetryInfo delay a pdserve server attached, in milliseconds, if any."""
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return int(info.retry_delay.ToMilliseconds())
    return None


def reason_of(error: grpc.RpcError) -> str | None:
    """The ErrorInfo.reason a pdserve server attached, if any."""
    status = rpc_status.from_call(error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return None


def from_rpc_error(
    error: grpc.aio.AioRpcError, what: str
) -> errors.PdserveError | grpc.aio.AioRpcError:
    """Turns a downstream status back into our error type, keeping its message."""
    code = error.code()
    message = f"{what}: {error.details()}"
    mapping: dict[grpc.StatusCode, Callable[[], errors.PdserveError]] = {
        grpc.StatusCode.INVALID_ARGUMENT: lambda: _invalid(error, message),
        grpc.StatusCode.RESOURCE_EXHAUSTED: lambda: errors.QueueFullError(message),
        grpc.StatusCode.NOT_FOUND: lambda: errors.NotFoundError(message),
        grpc.StatusCode.UNAVAILABLE: lambda: errors.UnavailableError(message),
        grpc.StatusCode.ALREADY_EXISTS: lambda: errors.AlreadyExistsError(message),
        grpc.StatusCode.FAILED_PRECONDITION: lambda: errors.FailedPreconditionError(message),
        grpc.StatusCode.DATA_LOSS: lambda: errors.DataLossError(message),
    }
    make = mapping.get(code)
    return make() if make is not None else error


def _invalid(error: grpc.aio.AioRpcError, message: str) -> errors.InvalidRequestError:
    status = rpc_status.from_call(error)
    field = "request"
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                if bad.field_violations:
                    field = bad.field_violations[0].field
    err = errors.InvalidRequestError(field, "")
    err.args = (error.details() or message,)
    return err


F = TypeVar("F", bound=Callable[..., Any])


def rpc_method(method: F) -> F:
    """Maps exceptions escaping a servicer method (unary or streaming) to statuses."""

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                # aclosing: a cancelled call runs the method's cleanup now, not at GC time.
                async with contextlib.aclosing(method(self, request, context)) as items:
                    async for item in items:
                        yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:
                _log(method, exc)
                await abort(context, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            _log(method, exc)
            await abort(context, exc)

    return unary  # type: ignore[return-value]


def _log(method: Callable[..., Any], exc: Exception) -> None:
    if status_code_for(exc) is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method.__qualname__)
    else:
        log.info("%s: %s: %s", method.__qualname__, type(exc).__name__, exc)

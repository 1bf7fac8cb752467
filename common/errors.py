"""Errors a caller can act on. One place (common/rpc/errors.py) maps them to gRPC status codes.

Each carries a stable ``reason`` (the ``google.rpc.ErrorInfo.reason`` clients switch on).
"""

from __future__ import annotations


class PdserveError(Exception):
    reason = "INTERNAL"


class InvalidRequestError(PdserveError, ValueError):
    """The request itself is wrong; ``field`` names the offending field."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(PdserveError):
    """A bounded queue is full; retry later or elsewhere.

    ``retry_after_ms``, when known, becomes a ``google.rpc.RetryInfo``; ``metadata`` goes
    into the ``google.rpc.ErrorInfo`` (which bound was hit, for whom).
    """

    reason = "QUEUE_FULL"

    def __init__(
        self,
        message: str,
        retry_after_ms: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.metadata = metadata or {}


class CapacityError(PdserveError):
    """The request can never fit (e.g. needs more KV blocks than the pool holds)."""

    reason = "KV_CAPACITY"


class NotFoundError(PdserveError, KeyError):
    reason = "NOT_FOUND"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class UnavailableError(PdserveError):
    """No worker (of a role) can take the request now."""

    reason = "UNAVAILABLE"


class UnauthenticatedError(PdserveError):
    """The call carries no valid credentials."""

    reason = "UNAUTHENTICATED"


class DrainingError(UnavailableError):
    """This process is draining (SIGTERM): it takes no new work, and ends what is left when
    its grace period is over; resume or retry elsewhere."""

    reason = "DRAINING"


class RoleChangedError(UnavailableError):
    """This engine worker does not serve the role the call needs (any more): its role
    changed in place (``pdserve role``, the planner). A decode stream it ended continues on
    another decode worker; a prefill goes to another prefill worker."""

    reason = "ROLE_CHANGED"


class PermissionDeniedError(PdserveError):
    """The caller is authenticated but may not make this call."""

    reason = "PERMISSION_DENIED"


class AlreadyExistsError(PdserveError):
    reason = "ALREADY_EXISTS"


class FailedPreconditionError(PdserveError):
    """The request is valid but does not fit this server's state (e.g. a layout mismatch)."""

    reason = "FAILED_PRECONDITION"


class DataLossError(PdserveError):
    """Bytes arrived corrupted (a checksum mismatch)."""

    reason = "DATA_LOSS"


class KvLoadError(UnavailableError):
    """A decode worker could load a request's KV neither from its producer nor from the block
    store, and runs with ``--kv-load-failure fail``. The request can be sent again whole."""

    reason = "KV_LOAD_FAILED"

"""Engine worker roles as names (common/planner/types.py) and as WorkerRole values."""

from __future__ import annotations

from common.errors import InvalidRequestError
from common.planner.types import BOTH, DECODE, PREFILL
from pdserve.common.v1 import common_pb2

ROLE_PB = {
    PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    DECODE: common_pb2.WORKER_ROLE_DECODE,
    BOTH: common_pb2.WORKER_ROLE_BOTH,
}
ROLE_OF_PB = {value: name for name, value in ROLE_PB.items()}


def role_from_pb(value: int) -> str:
    """The engine role a request names; INVALID_ARGUMENT for any other value."""
    role = ROLE_OF_PB.get(value)  # type: ignore[call-overload]
    if role is None:
        known = value in common_pb2.WorkerRole.values()
        shown = common_pb2.WorkerRole.Name(value) if known else str(value)
        raise InvalidRequestError(
            "role",
            f"must be WORKER_ROLE_PREFILL, WORKER_ROLE_DECODE or WORKER_ROLE_BOTH, got {shown}",
        )
    return str(role)

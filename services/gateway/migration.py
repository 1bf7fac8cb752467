"""Migration (lifecycle step 7): a decode stream that breaks mid-way continues on another
decode worker, and the client sees one stream.

A stream is broken, and the request may migrate, when the worker goes silent (no message
for ``--decode-stall-timeout-s``, and ``--prefill-timeout-s`` more before the first: a hung
process, say SIGSTOPped, whose connection stays open), or when the Decode call ends with
UNAVAILABLE (the worker died, the connection reset, the worker is draining, or it left the
decode role: reason ROLE_CHANGED), CANCELLED
(not by us: our own cancellation never reaches here), UNKNOWN, INTERNAL or ABORTED, or
ends OK without a final message; also with NOT_FOUND when the call carried a KV handle
whose blocks are gone everywhere (the contract's answer: retry with local prefill). Every
other status (the caller's deadline, a bad request, overload) is the request's answer.

The continuation is the same DecodeRequest with ``local_prefill`` and every token the
client has been sent as ``generated_token_ids``: the new worker imports the full blocks of
that context from the block store (the prefill worker wrote the prompt's, decode workers
write theirs behind) and computes only the tail. Sampling resumes at output position
``len(generated_token_ids)`` with the same seed and max_tokens (prompt logprobs, which
travel with the first token, are asked for again only when no token had arrived), and the
gateway keeps the request's detokenizer and stop-string state (``Relay``), so no token or
character is lost or repeated. A request migrates at most ``max_migrations`` times, never back to a process
whose stream broke (a restarted worker with the same id is a new process: its pid
differs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from common.errors import RoleChangedError
from common.index.registry import WorkerInfo
from common.rpc.errors import reason_of
from pdserve.decode.v1 import decode_pb2

# Metric label values of pdserve:request_migrations_total{reason}.
STREAM_ENDED = "stream_ended"  # the call ended OK without a final message
KV_NOT_FOUND = "kv_not_found"  # the KV handle's blocks are gone: recompute instead
DRAINING = "draining"  # the worker's drain grace period ended
STALLED = "stalled"  # no message within the stall timeout: the worker hangs
ROLE_CHANGED = "role_changed"  # the worker left the decode role (pdserve role, the planner)
REASONS = (
    "unavailable",
    DRAINING,
    "cancelled",
    "unknown",
    "internal",
    "aborted",
    STREAM_ENDED,
    KV_NOT_FOUND,
    STALLED,
    ROLE_CHANGED,
)

_BROKEN_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
    }
)


class StreamBroken(Exception):
    """A decode stream broke in a way another worker can continue from."""

    def __init__(self, reason: str, error: Exception) -> None:
        super().__init__(f"{reason}: {error}")
        self.reason = reason  # one of REASONS
        self.error = error  # what the client gets if the request cannot continue

    @property
    def worker_fault(self) -> bool:
        """The worker failed (not just the KV it was handed, nor a role it left): do not
        send it more."""
        return self.reason not in (KV_NOT_FOUND, ROLE_CHANGED)


def broken_reason(error: grpc.aio.AioRpcError, had_kv_handle: bool) -> str | None:
    """Why ``error`` broke the stream, as a REASONS label; None if it is the answer."""
    code = error.code()
    if code in _BROKEN_CODES:
        if code is grpc.StatusCode.UNAVAILABLE and reason_of(error) == "DRAINING":
            return DRAINING
        if code is grpc.StatusCode.UNAVAILABLE and reason_of(error) == RoleChangedError.reason:
            return ROLE_CHANGED
        return code.name.lower()
    if code is grpc.StatusCode.NOT_FOUND and had_kv_handle:
        return KV_NOT_FOUND
    return None


def continuation(
    request: decode_pb2.DecodeRequest, generated_token_ids: list[int]
) -> decode_pb2.DecodeRequest:
    """The request that continues ``request`` after ``generated_token_ids`` (every token the
    client has been sent, in order): local prefill, the same sampling (max_tokens counts
    the tokens carried)."""
    resumed = decode_pb2.DecodeRequest()
    resumed.CopyFrom(request)
    resumed.local_prefill = True  # clears kv_handle (one of kv_source)
    resumed.generated_token_ids[:] = generated_token_ids
    if generated_token_ids:  # the first token came with the prompt logprobs
        resumed.sampling.ClearField("prompt_logprobs")
    return resumed


@dataclass
class Migrations:
    """One request's migrations so far, and the processes it must not go back to. The limit
    bounds the migrations after failures; a stream moved because its worker left the
    decode role is not failing, and moves again as often as roles change."""

    limit: int
    count: int = 0
    num_failures: int = 0  # migrations counted against the limit
    _broken: set[tuple[str, int]] = field(default_factory=set)  # (worker_id, pid)

    def broke(self, worker: WorkerInfo, broken: StreamBroken) -> None:
        if broken.worker_fault:
            self._broken.add((worker.worker_id, worker.pid))

    def allows(self, worker: WorkerInfo) -> bool:
        return (worker.worker_id, worker.pid) not in self._broken

    def exhausted_by(self, broken: StreamBroken) -> bool:
        return broken.reason != ROLE_CHANGED and self.num_failures >= self.limit

    def moved(self, broken: StreamBroken) -> None:
        self.count += 1
        if broken.reason != ROLE_CHANGED:
            self.num_failures += 1

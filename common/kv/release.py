"""Handing a KV lease back to its producer (KvTransferService.ReleaseLease), retried while
the producer does not answer. No torch here: the gateway releases leases too."""

from __future__ import annotations

import asyncio
import time

import grpc

from common.rpc.tracing import outgoing_metadata
from pdserve.kv.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

RELEASE_RETRY_S = 60.0  # how long a lease release is retried when the producer does not answer
RELEASE_BACKOFF_S = 0.5
RELEASE_MAX_BACKOFF_S = 4.0
_NO_ANSWER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN}
)


async def release_lease(
    channel: grpc.aio.Channel,
    lease_id: str,
    timeout_s: float = 5.0,
    retry_for_s: float = 0.0,
    expiry_unix_ms: int = 0,
) -> bool:
    """Hands a lease back; True when it was live. A producer that cannot be reached or does
    not answer (dead, restarting, or hung: SIGSTOPped, swapping) is asked again, with
    backoff, for ``retry_for_s`` or until the lease would have expired anyway
    (``expiry_unix_ms``, when known), so that a producer that resumes frees the blocks then
    instead of holding them until the lease's TTL. A release that arrives before the lease
    exists leaves a tombstone there (see common/kv/leases.py), so asking early is safe."""
    give_up = time.monotonic() + retry_for_s
    if expiry_unix_ms:
        give_up = min(give_up, time.monotonic() + expiry_unix_ms / 1000 - time.time())
    backoff = RELEASE_BACKOFF_S
    while True:
        released = await _release_once(channel, lease_id, timeout_s)
        if released is not None:
            return released
        if time.monotonic() + backoff >= give_up:
            return False  # the producer is gone: its lease died with it, or expires
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RELEASE_MAX_BACKOFF_S)


async def _release_once(channel: grpc.aio.Channel, lease_id: str, timeout_s: float) -> bool | None:
    """True/False: the producer answered (the lease was live / was not); None: no answer."""
    stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
    try:
        response = await stub.ReleaseLease(
            kv_transfer_pb2.ReleaseLeaseRequest(lease_id=lease_id),
            timeout=timeout_s,
            metadata=outgoing_metadata(),
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() in _NO_ANSWER:
            return None
        return False
    return bool(response.released)

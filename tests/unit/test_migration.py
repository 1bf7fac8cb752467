"""The gateway's migration rules, and what routing knows of draining workers and pids."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.errors import DrainingError, InvalidRequestError, RoleChangedError, UnavailableError
from common.index.registry import WorkerInfo
from common.rpc.errors import to_status
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2
from services.gateway.directory import WorkerDirectory
from services.gateway.migration import (
    DRAINING,
    KV_NOT_FOUND,
    ROLE_CHANGED,
    Migrations,
    StreamBroken,
    broken_reason,
    continuation,
)
from services.gateway.routing import Router


def rpc_error(exc: Exception) -> grpc.aio.AioRpcError:
    """The error a client sees when a pdserve server ends a call with ``exc``."""
    status = to_status(exc)
    return grpc.aio.AioRpcError(
        grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == status.code)),
        grpc.aio.Metadata(),
        grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString())),
        details=status.message,
    )


def bare_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    """The error a client sees when the peer vanished (no pdserve status details)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "Socket closed")


def worker(worker_id: str, pid: int, running: int = 0, draining: bool = False) -> WorkerInfo:
    return WorkerInfo(
        worker_id, "decode", f"{worker_id}:1", "m", 100, 100, running, pid=pid, draining=draining
    )


def test_a_stream_ended_by_a_role_change_migrates_as_role_changed() -> None:
    error = rpc_error(RoleChangedError("worker d0 changed its role"))
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert broken_reason(error, had_kv_handle=False) == ROLE_CHANGED
    assert broken_reason(error, had_kv_handle=True) == ROLE_CHANGED


def test_broken_streams_migrate_and_answers_do_not() -> None:
    assert broken_reason(bare_error(grpc.StatusCode.UNAVAILABLE), False) == "unavailable"
    assert broken_reason(rpc_error(UnavailableError("gone")), False) == "unavailable"
    assert broken_reason(rpc_error(DrainingError("grace over")), False) == DRAINING
    for code in ("CANCELLED", "UNKNOWN", "INTERNAL", "ABORTED"):
        assert broken_reason(bare_error(grpc.StatusCode[code]), False) == code.lower()
    # NOT_FOUND: the handle's KV is gone; only a request that carried one continues.
    not_found = bare_error(grpc.StatusCode.NOT_FOUND)
    assert broken_reason(not_found, True) == KV_NOT_FOUND
    assert broken_reason(not_found, False) is None
    for code in ("DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"):
        assert broken_reason(bare_error(grpc.StatusCode[code]), True) is None
    assert broken_reason(rpc_error(InvalidRequestError("sampling.top_p", "bad")), True) is None


def test_continuation_carries_every_token_sent_and_recomputes_locally() -> None:
    request = decode_pb2.DecodeRequest(
        request_id="r1",
        prompt_token_ids=[5, 6, 7],
        generated_token_ids=[9],
        cache_salt="tenant",
        sampling=common_pb2.SamplingParams(max_tokens=20, seed=4, temperature=0.7),
        kv_handle=common_pb2.KvHandle(request_id="r1", lease_id="lease-1", num_tokens=3),
    )
    resumed = continuation(request, [9, 10, 11, 12])
    assert resumed.WhichOneof("kv_source") == "local_prefill" and resumed.local_prefill
    assert not resumed.HasField("kv_handle")
    assert list(resumed.generated_token_ids) == [9, 10, 11, 12]
    assert list(resumed.prompt_token_ids) == [5, 6, 7]
    assert (resumed.request_id, resumed.cache_salt) == ("r1", "tenant")
    assert resumed.sampling == request.sampling  # max_tokens counts the tokens carried
    assert request.HasField("kv_handle")  # the original is left as it was


def test_a_request_never_goes_back_to_a_process_it_broke_on() -> None:
    migrations = Migrations(limit=2)
    d0, d1 = worker("d0", pid=100), worker("d1", pid=200)
    migrations.broke(d0, StreamBroken("unavailable", UnavailableError("x")))
    assert not migrations.allows(d0) and migrations.allows(d1)
    # The same worker id restarted is a new process: it may take the request.
    assert migrations.allows(worker("d0", pid=101))
    # A KV handle whose blocks are gone is no fault of the worker.
    migrations.broke(d1, StreamBroken(KV_NOT_FOUND, UnavailableError("x")))
    assert migrations.allows(d1)
    failure = StreamBroken("unavailable", UnavailableError("x"))
    assert not migrations.exhausted_by(failure)
    migrations.moved(failure)
    migrations.moved(failure)
    assert migrations.exhausted_by(failure)


def test_a_worker_leaving_the_decode_role_is_no_fault_and_costs_no_migration() -> None:
    migrations = Migrations(limit=1)
    d0 = worker("d0", pid=100)
    moved = StreamBroken(ROLE_CHANGED, UnavailableError("role"))
    assert not moved.worker_fault
    for _ in range(5):  # as often as roles change
        assert not migrations.exhausted_by(moved)
        migrations.broke(d0, moved)
        migrations.moved(moved)
    assert migrations.allows(d0)  # it may take the stream again once it decodes again
    assert (migrations.count, migrations.num_failures) == (5, 0)
    failure = StreamBroken("unavailable", UnavailableError("x"))
    migrations.moved(failure)
    assert migrations.exhausted_by(failure) and not migrations.exhausted_by(moved)


def test_choose_decode_takes_the_least_loaded() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    busy, idle = worker("d0", 1, running=5), worker("d1", 2, running=1)
    assert router.choose_decode("r", [busy, idle]) is idle
    for _ in range(9):
        router.call_started("d1")
    assert router.choose_decode("r", [busy, idle]) is busy
    with pytest.raises(UnavailableError):
        router.choose_decode("r", [])


def test_registry_entries_carry_pid_and_draining() -> None:
    info = worker("d0", pid=4242, draining=True)
    raw = {k.encode(): v.encode() for k, v in info.to_redis().items()}
    assert raw[b"draining"] == b"1" and raw[b"pid"] == b"4242"
    assert WorkerInfo.from_redis(raw) == info
    # An entry written before these fields existed reads as not draining, pid unknown.
    older = {k: v for k, v in raw.items() if k not in (b"pid", b"draining")}
    back = WorkerInfo.from_redis(older)
    assert (back.pid, back.draining) == (0, False)


class _Registry:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers

    async def list(self) -> list[WorkerInfo]:
        return self.workers


def test_routing_skips_draining_workers() -> None:
    serving, draining = worker("d0", 1), worker("d1", 2, draining=True)
    directory = WorkerDirectory(_Registry([serving, draining]), refresh_s=0.0)  # type: ignore[arg-type]
    assert asyncio.run(directory.by_role("decode", "m")) == [serving]
    # Status still lists it.
    assert asyncio.run(directory.workers()) == [serving, draining]

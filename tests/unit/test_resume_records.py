"""The gateway's resume records (services/gateway/resume.py) against a real redis-server:
what a resume finds, in order, bound to its caller, gone after its TTL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from common.errors import InvalidRequestError, NotFoundError
from common.index import keys
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.resume import (
    ResumeMetrics,
    ResumeRecord,
    ResumeStore,
    check_resume,
    make_token,
    parse_token,
)
from tests.redis_server import RedisServer, redis_server

pytestmark = pytest.mark.redis

MODEL = "m"


def worker_request(salt: str = "tenant-a") -> decode_pb2.DecodeRequest:
    request = decode_pb2.DecodeRequest(request_id="r1", prompt_token_ids=[5, 6, 7],
                                       cache_salt=salt)  # fmt: skip
    request.sampling.max_tokens = 9
    request.sampling.seed = 42
    request.kv_handle.request_id = "kv"  # not kept: a resume prefills locally
    request.generated_token_ids.append(1)
    return request


async def settle(store: ResumeStore) -> None:
    await store.close(timeout_s=5)


def test_a_record_holds_the_request_its_tokens_in_order_and_its_end(tmp_path: Path) -> None:
    async def body() -> tuple[ResumeRecord | None, int, float]:
        with redis_server(tmp_path) as url:
            client = aioredis.from_url(url)
            metrics = ResumeMetrics(CollectorRegistry())
            store = ResumeStore(client, MODEL, ttl_s=60, metrics=metrics)
            resume_id = store.begin(worker_request())
            for tokens in ([11], [12, 13], [], [14]):  # sent without waiting for Redis
                store.sent(resume_id, tokens)
            final = gateway_pb2.GenerateResponse(text="x", token_ids=[14],
                                                 finish_reason=common_pb2.FINISH_REASON_LENGTH)  # fmt: skip
            final.usage.completion_tokens = 4
            store.finished(resume_id, final)
            await settle(store)
            record = await store.load(resume_id)
            ttl = await client.pttl(keys.resume(MODEL, resume_id))
            writing = metrics.records_writing._value.get()  # type: ignore[attr-defined]
            await client.aclose()
            return record, ttl, writing

    record, ttl, writing = asyncio.run(body())
    assert record is not None
    assert list(record.request.prompt_token_ids) == [5, 6, 7]
    assert record.request.sampling.seed == 42 and record.request.cache_salt == "tenant-a"
    assert not record.request.HasField("kv_handle") and not record.request.generated_token_ids
    assert record.tokens == [11, 12, 13, 14]
    assert record.final is not None and record.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert record.final.usage.completion_tokens == 4 and not record.final.token_ids
    assert 0 < ttl <= 60_000
    assert writing == 0  # nothing held once the end is written


def test_records_expire_and_an_unknown_one_is_none(tmp_path: Path) -> None:
    async def body() -> tuple[bool, bool]:
        with redis_server(tmp_path) as url:
            client = aioredis.from_url(url)
            store = ResumeStore(client, MODEL, ttl_s=0.2)
            resume_id = store.begin(worker_request())
            store.sent(resume_id, [3])
            await settle(store)
            present = await store.load(resume_id) is not None
            await asyncio.sleep(0.5)
            gone = await store.load(resume_id) is None
            unknown = await store.load("0" * 32)
            await client.aclose()
            return present, gone and unknown is None

    assert asyncio.run(body()) == (True, True)


def test_a_dead_redis_costs_the_stream_nothing_and_holds_nothing(tmp_path: Path) -> None:
    async def body() -> tuple[float, float]:
        server = RedisServer(tmp_path)
        server.start()
        client = aioredis.from_url(server.url, socket_timeout=0.5)
        metrics = ResumeMetrics(CollectorRegistry())
        store = ResumeStore(client, MODEL, ttl_s=60, metrics=metrics)
        server.kill()
        resume_id = store.begin(worker_request())
        store.sent(resume_id, [1, 2])
        store.finished(resume_id, gateway_pb2.GenerateResponse())
        await settle(store)
        await client.aclose()
        return metrics.write_failures._value.get(), metrics.records_writing._value.get()  # type: ignore[attr-defined]

    failures, writing = asyncio.run(body())
    assert failures >= 1 and writing == 0


def test_a_resume_is_checked_against_its_record() -> None:
    record = ResumeRecord(worker_request("tenant-a"), [11, 12, 13], None)
    assert check_resume(record, "tenant-a", [11, 12]) == (record, [11, 12])
    # Beyond what is written: the client's tokens are taken.
    assert check_resume(record, "tenant-a", [11, 12, 13, 14]) == (record, [11, 12, 13, 14])
    # No tokens sent (server-sent events): the record's, as far as the token says.
    assert check_resume(record, "tenant-a", [], position=2) == (record, [11, 12])
    with pytest.raises(InvalidRequestError, match="the record holds 3"):
        check_resume(record, "tenant-a", [], position=4)
    with pytest.raises(NotFoundError):
        check_resume(record, "tenant-b", [11])  # another tenant: as if there were none
    with pytest.raises(NotFoundError):
        check_resume(None, "tenant-a", [])
    with pytest.raises(InvalidRequestError, match="position 1 holds token 99; the request sent 12"):
        check_resume(record, "tenant-a", [11, 99, 13])
    ended = ResumeRecord(worker_request("tenant-a"), [11, 12], gateway_pb2.GenerateResponse())
    with pytest.raises(InvalidRequestError, match="ended after 2"):
        check_resume(ended, "tenant-a", [11, 12, 13])


def test_resume_tokens_name_a_record_and_a_position() -> None:
    token = make_token("ab" * 16, 7)
    assert parse_token(token) == ("ab" * 16, 7)
    for bad in ("", "abc.1", "ab" * 16, f"{'zz' * 16}.1", f"{'ab' * 16}.x", "../../etc.1"):
        with pytest.raises(InvalidRequestError, match=r"resume\.resume_token"):
            parse_token(bad)
    with pytest.raises(ValueError):
        keys.resume(MODEL, "not-hex")

"""Every bad input gets its status code through the real gateway, naming the field, while a
well-formed greedy stream runs alongside and completes exactly as it does alone.

The status codes are those of gateway.proto: INVALID_ARGUMENT naming the field (in the
message and in the google.rpc.BadRequest field violation), NOT_FOUND for an unknown model,
ALREADY_EXISTS for a request_id in flight, RESOURCE_EXHAUSTED when admission is full (an
in-process gateway with max_in_flight 1) and UNAVAILABLE when no decode worker is alive (an
in-process gateway on a Redis database where only a prefill worker is registered).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest
import redis.asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from common.contract.sampling import SamplingParams
from common.errors import InvalidRequestError
from common.index.registry import WorkerInfo, WorkerRegistry
from common.rpc.errors import reason_of, retry_delay_ms
from pdserve.cli.launcher import StackState
from pdserve.client import GatewayClient, RemoteCompletion, collect
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.server import start_gateway, stop_gateway
from services.gateway.servicer import GatewayServicer
from tests.integration.conftest import Stack
from tests.polling import settle_async, until_async
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

ModelInfo = gateway_pb2.GetModelInfoResponse
WITNESS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
WITNESS_PROMPT = prompt_with_context(1, 3)


def generate(**fields: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(**fields)


def sampled(request: gateway_pb2.GenerateRequest, **values: object) -> gateway_pb2.GenerateRequest:
    for name, value in values.items():
        field = getattr(request.sampling, name)
        if isinstance(value, list):
            field.extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def hello(**values: object) -> gateway_pb2.GenerateRequest:
    return sampled(generate(raw_prompt="Hello"), **values)


def constrained(**constraint: str) -> gateway_pb2.GenerateRequest:
    request = hello()
    request.sampling.structured_output.CopyFrom(common_pb2.StructuredOutput(**constraint))
    return request


def streaming(**eviction: int) -> gateway_pb2.GenerateRequest:
    request = hello()
    request.sampling.kv_eviction.CopyFrom(common_pb2.KvEviction(**eviction))
    return request


def compressed(**compression: int) -> gateway_pb2.GenerateRequest:
    request = hello()
    request.sampling.kv_compression.CopyFrom(common_pb2.KvCompression(**compression))
    return request


def with_id(request_id: str, max_tokens: int = 4) -> gateway_pb2.GenerateRequest:
    request = hello(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request.request_id = request_id
    return request


@dataclass(frozen=True)
class BadInput:
    name: str
    build: Callable[[ModelInfo], gateway_pb2.GenerateRequest]
    code: grpc.StatusCode
    field: str  # named in details(); for INVALID_ARGUMENT also the BadRequest field violation


def _invalid(
    name: str, field: str, build: Callable[[ModelInfo], gateway_pb2.GenerateRequest]
) -> BadInput:
    return BadInput(name, build, grpc.StatusCode.INVALID_ARGUMENT, field)


CASES = [
    _invalid("no_input", "input", lambda info: generate()),
    _invalid("empty_prompt", "prompt", lambda info: generate(prompt="")),
    _invalid("empty_raw_prompt", "raw_prompt", lambda info: generate(raw_prompt="")),
    _invalid("empty_token_ids", "token_ids", lambda info: generate(token_ids={})),
    _invalid("empty_messages", "messages", lambda info: generate(messages={})),
    _invalid(
        "unknown_role",
        "messages[1].role",
        lambda info: generate(
            messages={
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "wizard", "content": "Abracadabra"},
                ]
            }
        ),
    ),
    _invalid(
        "prompt_fills_the_context",
        "token_ids",
        lambda info: generate(token_ids={"ids": [1] * info.max_context_tokens}),
    ),
    _invalid(
        "max_tokens_past_the_context",
        "sampling.max_tokens",
        lambda info: hello(max_tokens=info.max_context_tokens),
    ),
    _invalid(
        "regex_that_does_not_compile",
        "sampling.structured_output.regex",
        lambda i: constrained(regex="[a-z"),
    ),
    _invalid(
        "json_schema_llguidance_rejects",
        "sampling.structured_output.json_schema",
        lambda i: constrained(json_schema='{"type": "objekt"}'),
    ),
    _invalid(
        "grammar_with_an_undefined_rule",
        "sampling.structured_output.grammar",
        lambda i: constrained(grammar="start: nowhere"),
    ),
    _invalid(
        "eviction_window_under_a_block",
        "sampling.kv_eviction.window_tokens",
        lambda i: streaming(sink_tokens=4, window_tokens=8),
    ),
    _invalid(
        "eviction_without_a_window",
        "sampling.kv_eviction.window_tokens",
        lambda i: streaming(sink_tokens=4),
    ),
    _invalid(
        "snapkv_without_a_budget",
        "sampling.kv_compression.budget_tokens",
        lambda i: compressed(window_tokens=16),
    ),
    _invalid(
        "snapkv_budget_with_no_room",
        "sampling.kv_compression.budget_tokens",
        lambda i: compressed(budget_tokens=40, window_tokens=16),
    ),
    _invalid("negative_temperature", "sampling.temperature", lambda i: hello(temperature=-0.5)),
    _invalid("nan_temperature", "sampling.temperature", lambda i: hello(temperature=math.nan)),
    _invalid("top_p_zero", "sampling.top_p", lambda i: hello(top_p=0.0)),
    _invalid("top_p_above_one", "sampling.top_p", lambda i: hello(top_p=1.5)),
    _invalid("min_p_above_one", "sampling.min_p", lambda i: hello(min_p=1.5)),
    _invalid(
        "repetition_penalty_zero",
        "sampling.repetition_penalty",
        lambda i: hello(repetition_penalty=0.0),
    ),
    _invalid(
        "presence_penalty_too_high",
        "sampling.presence_penalty",
        lambda i: hello(presence_penalty=2.5),
    ),
    _invalid(
        "frequency_penalty_too_low",
        "sampling.frequency_penalty",
        lambda i: hello(frequency_penalty=-3.0),
    ),
    _invalid("too_many_top_logprobs", "sampling.top_logprobs", lambda i: hello(top_logprobs=21)),
    _invalid("empty_stop_string", "sampling.stop", lambda i: hello(stop=[""])),
    _invalid(
        "token_id_outside_the_vocabulary",
        "token_ids",
        lambda info: generate(token_ids={"ids": [1, info.vocab_size]}),
    ),
    _invalid(
        "stop_token_id_outside_the_vocabulary",
        "sampling.stop_token_ids",
        lambda info: hello(stop_token_ids=[info.vocab_size + 7]),
    ),
    BadInput(
        "unknown_model",
        lambda info: generate(raw_prompt="Hello", model="no-such-model"),
        grpc.StatusCode.NOT_FOUND,
        "model",
    ),
]

# Absurd sizes: each refused from field sizes alone, before admission and tokenization.
ABSURD = [
    _invalid("a_billion_max_tokens", "sampling.max_tokens", lambda i: hello(max_tokens=10**9)),
    _invalid("100k_stop_strings", "sampling.stop", lambda i: hello(stop=["a"] * 100_000)),
    _invalid("a_5000_character_stop_string", "sampling.stop", lambda i: hello(stop=["a" * 5000])),
    _invalid(
        "5000_stop_token_ids", "sampling.stop_token_ids", lambda i: hello(stop_token_ids=[1] * 5000)
    ),
    _invalid(
        "a_conversation_of_20k_turns",
        "messages",
        lambda i: generate(messages={"messages": [{"role": "user", "content": "Hi"}] * 20_000}),
    ),
    _invalid("a_prompt_of_2m_characters", "prompt", lambda i: generate(prompt="word " * 400_000)),
    _invalid("100k_token_ids", "token_ids", lambda i: generate(token_ids={"ids": [1] * 100_000})),
]
CASES += ABSURD


def field_violations(error: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(error)
    fields = []
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return fields


def problems(case: BadInput, error: grpc.aio.AioRpcError | None) -> list[str]:
    """What is wrong with the answer to one bad input; empty when it is right."""
    if error is None:
        return [f"{case.name}: accepted"]
    found = []
    if error.code() is not case.code:
        found.append(f"{case.name}: {error.code().name} ({error.details()})")
    if case.field not in (error.details() or ""):
        found.append(f"{case.name}: {case.field!r} not in {error.details()!r}")
    if reason_of(error) is None:
        found.append(f"{case.name}: no google.rpc.ErrorInfo")
    if case.code is grpc.StatusCode.INVALID_ARGUMENT and field_violations(error) != [case.field]:
        found.append(f"{case.name}: BadRequest fields {field_violations(error)}")
    return found


async def rejection(
    stub: gateway_pb2_grpc.GatewayServiceStub | grpc.aio.UnaryStreamMultiCallable,
    request: gateway_pb2.GenerateRequest,
) -> grpc.aio.AioRpcError | None:
    """The error a Generate call ends with (None if it was accepted: it is cancelled then)."""
    generate = stub if callable(stub) else stub.Generate
    call = generate(request, timeout=30)
    try:
        async for _ in call:
            call.cancel()
            return None
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


async def model_info(target: str) -> ModelInfo:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        info: ModelInfo = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
        return info


@pytest.fixture(scope="module")
def info(stack: Stack) -> ModelInfo:
    return asyncio.run(model_info(stack.target))


def redis_url(stack: Stack, db: int = 0) -> str:
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None, "the stack recorded no state"
    return f"{state.redis_url.rsplit('/', 1)[0]}/{db}"


@contextlib.asynccontextmanager
async def in_process_gateway(
    stack: Stack, url: str, **overrides: object
) -> AsyncIterator[GatewayServicer]:
    config = GatewayConfig(
        model=str(stack.model_dir),
        redis_url=url,
        port=0,
        worker_id=f"gateway-test-{uuid.uuid4().hex[:8]}",
        **overrides,
    )
    server, servicer, resources = await start_gateway(config)
    try:
        yield servicer
    finally:
        await server.stop(0)
        await stop_gateway(servicer, resources)


@contextlib.asynccontextmanager
async def registry_without_decode(stack: Stack) -> AsyncIterator[str]:
    """A Redis database of the stack's server holding one prefill worker and nothing else."""
    url = redis_url(stack, db=1)
    client = redis.asyncio.from_url(url)
    try:
        await client.flushdb()
        await WorkerRegistry(client, ttl_s=120).heartbeat(
            WorkerInfo("prefill-lonely", "prefill", "127.0.0.1:9", model=stack.model_dir.name)
        )
        yield url
    finally:
        await client.flushdb()
        await client.aclose()


async def queue_full_rejection(busy: GatewayServicer) -> tuple[grpc.aio.AioRpcError | None, float]:
    """With one request in flight on a max_in_flight=1 gateway, a second one's error and how
    long its answer took."""
    async with grpc.aio.insecure_channel(busy.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        holder = stub.Generate(hello(max_tokens=200, temperature=0.0, ignore_eos=True))
        async def holding() -> bool:
            return busy.num_in_flight >= 1

        await until_async("the first request is in flight", holding, 30.0, every_s=0.01)
        start = time.monotonic()
        error = await rejection(stub, hello(max_tokens=4))
        elapsed = time.monotonic() - start
        holder.cancel()
        return error, elapsed


async def unavailable_rejection(empty: GatewayServicer) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(empty.address) as channel:
        return await rejection(gateway_pb2_grpc.GatewayServiceStub(channel), hello(max_tokens=4))


async def witness(
    target: str, request_id: str = "", started: asyncio.Event | None = None
) -> RemoteCompletion:
    """The well-formed stream: greedy, 40 tokens, its own cache salt (computed from scratch)."""
    request = generate(
        prompt=WITNESS_PROMPT, request_id=request_id, cache_salt=f"witness-{uuid.uuid4().hex}"
    )
    WITNESS.to_pb(request.sampling)
    result = RemoteCompletion()
    async with grpc.aio.insecure_channel(target) as channel:
        async for message in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request):
            collect(result, message)
            if started is not None and message.token_ids:
                started.set()
    return result


# -- the table, one input at a time ------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_its_status_naming_the_field(
    stack: Stack, info: ModelInfo, case: BadInput
) -> None:
    async def run() -> grpc.aio.AioRpcError | None:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            return await rejection(gateway_pb2_grpc.GatewayServiceStub(channel), case.build(info))

    assert problems(case, asyncio.run(run())) == []


def test_absurd_fields_are_refused_cheaply(stack: Stack, info: ModelInfo) -> None:
    """Tokenizing the 2M-character prompt alone takes seconds here; refusing it does not."""

    async def run() -> list[float]:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            elapsed = []
            for case in ABSURD:
                request = case.build(info)
                start = time.monotonic()
                await rejection(stub, request)
                elapsed.append(time.monotonic() - start)
            return elapsed

    elapsed = asyncio.run(run())
    slow = {c.name: round(s, 2) for c, s in zip(ABSURD, elapsed, strict=True) if s > 0.5}
    assert not slow, slow


def test_oversized_and_unparseable_messages(stack: Stack) -> None:
    """A request over the gateway's 4 MiB receive limit is refused by gRPC itself,
    RESOURCE_EXHAUSTED before anything parses it; bytes that do not parse (a truncated field,
    groups nested past protobuf's limit) are INVALID_ARGUMENT, not grpc's UNKNOWN."""

    async def run() -> list[grpc.aio.AioRpcError | None]:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            raw = channel.unary_stream(
                "/pdserve.gateway.v1.GatewayService/Generate",
                request_serializer=bytes,
                response_deserializer=gateway_pb2.GenerateResponse.FromString,
            )
            oversized = generate(raw_prompt="x" * (5 * 1024 * 1024)).SerializeToString()
            errors = []
            for payload in (oversized, b"\x0a\x05ab", b"\x4b" * 200 + b"\x4c" * 200):
                errors.append(await rejection(raw, payload))  # type: ignore[arg-type]
            return errors

    oversized, truncated, nested = asyncio.run(run())
    assert oversized is not None and oversized.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (oversized.details() or ""), oversized
    for error in (truncated, nested):
        assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert "GenerateRequest" in (error.details() or "")


def test_model_info_states_the_context_the_workers_serve(stack: Stack, info: ModelInfo) -> None:
    # The workers' KV pools (256 MiB each) hold fewer tokens than SmolLM2's 8192 positions.
    workers = [w for w in stack.workers() if w["role"] in ("prefill", "decode")]
    pool_tokens = min(int(w["kv_blocks_total"]) for w in workers) * info.block_size
    assert info.max_context_tokens == min(8192, pool_tokens)


def test_max_tokens_filling_the_context_exactly_is_accepted(stack: Stack, info: ModelInfo) -> None:
    async def run() -> tuple[int, grpc.aio.AioRpcError | None]:
        client = GatewayClient(stack.target)
        try:
            tokenized = await client.stub.Tokenize(gateway_pb2.TokenizeRequest(raw_prompt="Hello"))
            max_tokens = info.max_context_tokens - len(tokenized.token_ids)
            return max_tokens, await rejection(client.stub, hello(max_tokens=max_tokens))
        finally:
            await client.close()

    max_tokens, error = asyncio.run(run())
    assert error is None, (max_tokens, error)  # the first token came; then it was cancelled


def test_top_k_cannot_be_negative_on_the_wire() -> None:
    # SamplingParams.top_k is a uint32: no client of this proto can send -1.
    with pytest.raises(ValueError):
        common_pb2.SamplingParams(top_k=-1)
    # A client built from a proto that declares top_k as int32 sends -1 as the 10-byte varint
    # of 2**64 - 1; as a uint32 it reads 2**32 - 1: keep the 4294967295 most likely tokens,
    # every token there is, which is valid (top_k disabled in effect).
    wire = bytes([4 << 3]) + b"\xff" * 9 + b"\x01"
    assert common_pb2.SamplingParams.FromString(wire).top_k == 2**32 - 1
    # The check the gateway runs on every decoded value, reached by no wire value.
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(top_k=-1)
    assert raised.value.field == "sampling.top_k"


def test_a_request_id_in_flight_is_already_exists(stack: Stack) -> None:
    request_id = f"dup-{uuid.uuid4().hex[:8]}"

    async def run() -> tuple[grpc.aio.AioRpcError | None, grpc.aio.AioRpcError | None]:
        async with grpc.aio.insecure_channel(stack.target) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            first = stub.Generate(with_id(request_id, max_tokens=200))
            await anext(aiter(first))  # in flight: a token came
            duplicate = await rejection(stub, with_id(request_id))
            first.cancel()


            def still_busy(again: grpc.aio.AioRpcError | None) -> bool:
                return again is not None and again.code() is grpc.StatusCode.ALREADY_EXISTS

            # The gateway hears of the cancel within 10 s.
            again = await settle_async(
                lambda: rejection(stub, with_id(request_id)),
                lambda again: not still_busy(again), 10.0, every_s=0.1,
            )  # fmt: skip
            return duplicate, again

    duplicate, again = asyncio.run(run())
    assert duplicate is not None and duplicate.code() is grpc.StatusCode.ALREADY_EXISTS
    assert request_id in (duplicate.details() or "")
    assert reason_of(duplicate) == "ALREADY_EXISTS"
    assert again is None, again  # the id is free once its request has ended


def test_full_admission_is_resource_exhausted_at_once(stack: Stack) -> None:
    async def run() -> tuple[grpc.aio.AioRpcError | None, float, grpc.aio.AioRpcError | None]:
        async with in_process_gateway(stack, redis_url(stack), max_in_flight=1) as busy:
            error, elapsed = await queue_full_rejection(busy)

            async def idle() -> bool:
                return busy.num_in_flight == 0

            await until_async("the first request has ended", idle, 30.0)
            async with grpc.aio.insecure_channel(busy.address) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                later = await rejection(stub, hello(max_tokens=4))
            return error, elapsed, later

    error, elapsed, later = asyncio.run(run())
    assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert reason_of(error) == "QUEUE_FULL"
    delay = retry_delay_ms(error)  # google.rpc.RetryInfo, in milliseconds
    assert delay is not None and 10 <= delay <= 30_000, delay
    assert elapsed < 1.0, f"answered after {elapsed:.2f}s"
    assert later is None, later  # the holder left: admission is open again


def test_no_decode_worker_is_unavailable(stack: Stack) -> None:
    async def run() -> grpc.aio.AioRpcError | None:
        async with (
            registry_without_decode(stack) as url,
            in_process_gateway(stack, url) as empty,
        ):
            return await unavailable_rejection(empty)

    error = asyncio.run(run())
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE, error
    assert "decode" in (error.details() or "")
    assert reason_of(error) == "UNAVAILABLE"


# -- all of them at once, beside a stream that must not notice -----------------------------------


def test_bad_inputs_leave_a_concurrent_stream_unharmed(stack: Stack, info: ModelInfo) -> None:
    alone = asyncio.run(witness(stack.target))
    assert alone.finish_reason == "length" and len(alone.token_ids) == WITNESS.max_tokens
    request_id = f"witness-{uuid.uuid4().hex[:8]}"

    async def run() -> tuple[RemoteCompletion, list[str], bool]:
        async with (
            registry_without_decode(stack) as url,
            in_process_gateway(stack, url) as empty,
            in_process_gateway(stack, redis_url(stack), max_in_flight=1) as busy,
            grpc.aio.insecure_channel(stack.target) as channel,
        ):
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            started = asyncio.Event()
            stream = asyncio.create_task(witness(stack.target, request_id, started))
            await started.wait()
            errors = await asyncio.gather(*(rejection(stub, c.build(info)) for c in CASES))
            found = [p for c, e in zip(CASES, errors, strict=True) for p in problems(c, e)]
            duplicate = await rejection(stub, with_id(request_id))
            full, _ = await queue_full_rejection(busy)
            unavailable = await unavailable_rejection(empty)
            for name, error, code in [
                ("duplicate request_id", duplicate, grpc.StatusCode.ALREADY_EXISTS),
                ("admission full", full, grpc.StatusCode.RESOURCE_EXHAUSTED),
                ("no decode worker", unavailable, grpc.StatusCode.UNAVAILABLE),
            ]:
                if error is None or error.code() is not code:
                    found.append(f"{name}: {error}")
            overlapped = not stream.done()
            return await stream, found, overlapped

    beside, found, overlapped = asyncio.run(run())
    assert found == []
    assert overlapped, "the stream ended before the bad inputs were all answered"
    assert beside.token_ids == alone.token_ids
    assert beside.text == alone.text
    assert beside.finish_reason == "length"
    assert beside.request_id == request_id

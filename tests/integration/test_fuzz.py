"""Fuzzing the real stack with messages drawn field by field from the proto descriptors
(tests/fuzz/strategies.py): the public GatewayService through the gateway, and every
internal service (prefill, decode, KV transfer, block store) on its own port.

No input may end INTERNAL or UNKNOWN, outlive its deadline, kill a process, log an ERROR, or
leave a KV block held: afterwards every pool is entirely free again within 15 s, as after
cancellations (test_cancellation.py). Examples are derandomized (the same every run);
PDSERVE_FUZZ_EXAMPLES_SCALE scales them (CI: the default, about a minute in all).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.cli.launcher import StackState
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.kv.v1 import (
    block_store_pb2,
    block_store_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
)
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from tests.fuzz.strategies import messages, mostly
from tests.integration.conftest import Stack
from tests.integration.test_cancellation import assert_everything_free, server_faults

pytestmark = pytest.mark.slow

SCALE = float(os.environ.get("PDSERVE_FUZZ_EXAMPLES_SCALE", "1"))
CALL_TIMEOUT_S = 8.0
SLACK_S = 5.0  # a call's answer may lag its deadline by this much, no more
MAX_MESSAGES = 3  # read this many stream messages, then cancel: enough to reach decode
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
VOCAB = 49_152  # SmolLM2's

# Token ids mostly inside the vocabulary (so requests get past validation and run), some
# at and beyond its edge; short generations; addresses only on loopback.
_TOKEN = mostly(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, VOCAB + 1, 2**32 - 1]), 15)
_MAX_TOKENS = mostly(st.integers(1, 6), st.sampled_from([0, 10**9, 2**32 - 1, 8191, 8192]))
_ANY_FLOAT = st.floats(width=32)
_ID = mostly(st.text(min_size=1, max_size=24), st.text(max_size=200), 7)
COMMON = {
    "pdserve.common.v1.SamplingParams.max_tokens": _MAX_TOKENS,
    "pdserve.common.v1.SamplingParams.temperature": mostly(st.floats(0, 2, width=32), _ANY_FLOAT),
    "pdserve.common.v1.SamplingParams.top_p": mostly(st.floats(0.125, 1, width=32), _ANY_FLOAT),
    "pdserve.common.v1.SamplingParams.min_p": mostly(st.floats(0, 1, width=32), _ANY_FLOAT),
    "pdserve.common.v1.SamplingParams.repetition_penalty": mostly(
        st.floats(0.125, 3, width=32), _ANY_FLOAT
    ),
    "pdserve.common.v1.SamplingParams.presence_penalty": mostly(
        st.floats(-2, 2, width=32), _ANY_FLOAT
    ),
    "pdserve.common.v1.SamplingParams.frequency_penalty": mostly(
        st.floats(-2, 2, width=32), _ANY_FLOAT
    ),
    "pdserve.common.v1.SamplingParams.stop": mostly(st.text(min_size=1, max_size=4), st.text(), 15),
    "pdserve.common.v1.SamplingParams.stop_token_ids": _TOKEN,
    "pdserve.common.v1.SamplingParams.top_logprobs": st.integers(0, 22),
}
REQUIRED = frozenset(
    {
        "pdserve.prefill.v1.PrefillRequest.request_id",
        "pdserve.prefill.v1.PrefillRequest.prompt_token_ids",
        "pdserve.decode.v1.DecodeRequest.request_id",
        "pdserve.decode.v1.DecodeRequest.prompt_token_ids",
        "pdserve.kv.v1.PullBlocksRequest.lease_id",
        "pdserve.kv.v1.PullBlocksRequest.request_id",
    }
)


def examples(count: int) -> Any:
    return settings(
        max_examples=max(1, int(count * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


class Tally:
    """Status codes seen, and the problems found (forbidden codes, late answers)."""

    def __init__(self) -> None:
        self.codes: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()  # INVALID_ARGUMENT by field, for the report
        self.problems: list[str] = []

    def record(
        self,
        what: str,
        code: grpc.StatusCode | str,
        elapsed_s: float,
        request: Any,
        details: str = "",
    ) -> None:
        self.codes[f"{what}:{code if isinstance(code, str) else code.name}"] += 1
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            self.refusals[f"{what}:{details.split(':', 1)[0][:40]}"] += 1
        if code in FORBIDDEN:
            self.problems.append(f"{what} -> {code.name} ({details}): {request!r:.400}")
        if elapsed_s > CALL_TIMEOUT_S + SLACK_S:
            self.problems.append(f"{what} answered after {elapsed_s:.1f}s: {request!r:.400}")


Outcome = tuple[grpc.StatusCode | str, str]  # code (or CLIENT_WRITE_RACE), details
# grpcio's aio client turns a write that races the server's early answer into its own
# INTERNAL "Internal error from Core" and drops the status the server sent (the write fails
# inside the client library, grpc/aio/_call.py _write -> set_internal_error). Such an outcome
# says nothing about the server; it is tallied under this name. A server-sent INTERNAL
# carries the server's own details and stays a problem.
CLIENT_WRITE_RACE = "CLIENT_WRITE_RACE"
CORE_INTERNAL = "Internal error from Core"


async def unary(call: Callable[..., Any], request: Any) -> tuple[Outcome, Any]:
    try:
        return (grpc.StatusCode.OK, ""), await call(request, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return (exc.code(), exc.details() or ""), None


async def client_stream(method: Any, requests: list[Any]) -> Outcome:
    """Writes the requests one by one and returns the server's status. (With an iterator,
    grpcio reports a write that raced the server's early answer as its own INTERNAL
    'Failed execute_batch', hiding the status the server sent.)"""
    call = method(timeout=CALL_TIMEOUT_S)
    write_failed = False
    try:
        for request in requests:
            await call.write(request)
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        write_failed = True  # the server answered before reading everything
    try:
        await call
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        if (
            write_failed
            and exc.code() is grpc.StatusCode.INTERNAL
            and exc.details() == CORE_INTERNAL
        ):
            return CLIENT_WRITE_RACE, exc.details()
        return exc.code(), exc.details() or ""


async def streamed(call: Any) -> Outcome:
    """Reads up to MAX_MESSAGES, then cancels (our own cancel counts as OK)."""
    try:
        count = 0
        async for _ in call:
            count += 1
            if count >= MAX_MESSAGES:
                call.cancel()
                break
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    except asyncio.CancelledError:
        return grpc.StatusCode.OK, ""


def timed(tally: Tally, what: str, request: Any, body: Callable[[], Any]) -> None:
    start = time.monotonic()
    code, details = asyncio.run(body())
    tally.record(what, code, time.monotonic() - start, request, details)


def addresses(stack: Stack) -> dict[str, str]:
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None
    return {c.name: c.address for c in state.children}


@pytest.fixture(scope="module")
def baseline(stack: Stack) -> list[str]:
    assert_everything_free(stack)
    return server_faults(stack)


def test_fuzzed_gateway_requests(stack: Stack, baseline: list[str]) -> None:
    model = stack.model_dir.name
    overrides = {
        **COMMON,
        "pdserve.gateway.v1.TokenIds.ids": _TOKEN,
        "pdserve.gateway.v1.ChatMessage.role": mostly(
            st.sampled_from(["user", "assistant", "system"]), st.text(), 7
        ),
        "pdserve.gateway.v1.GenerateRequest.model": st.sampled_from(["", model, "nope"]),
        "pdserve.gateway.v1.TokenizeRequest.model": st.sampled_from(["", model]),
    }
    tally = Tally()

    # Besides the drawn inputs, one well-formed request of each kind runs every time, so
    # that whatever the Hypothesis version draws, the checks below see real generation.
    @examples(150)
    @example(
        gateway_pb2.GenerateRequest(
            model=model,
            prompt="Say hello.",
            sampling=common_pb2.SamplingParams(max_tokens=2),
        ),
        gateway_pb2.TokenizeRequest(model=model, prompt="hello"),
        gateway_pb2.GetModelInfoRequest(),
    )
    @given(
        messages(gateway_pb2.GenerateRequest, overrides),
        messages(gateway_pb2.TokenizeRequest, overrides),
        messages(gateway_pb2.GetModelInfoRequest, overrides),
    )
    def fuzz(
        generate: gateway_pb2.GenerateRequest,
        tokenize: gateway_pb2.TokenizeRequest,
        info: gateway_pb2.GetModelInfoRequest,
    ) -> None:
        async def body(call: Callable[[gateway_pb2_grpc.GatewayServiceStub], Any]) -> Any:
            async with grpc.aio.insecure_channel(stack.target) as channel:
                return await call(gateway_pb2_grpc.GatewayServiceStub(channel))

        timed(tally, "Generate", generate, lambda: body(
            lambda stub: streamed(stub.Generate(generate, timeout=CALL_TIMEOUT_S))))  # fmt: skip
        for name, request in (("Tokenize", tokenize), ("GetModelInfo", info)):
            timed(tally, name, request, lambda n=name, r=request: body(
                lambda stub: _code(unary(getattr(stub, n), r))))  # fmt: skip

    fuzz()
    print("gateway fuzz:", dict(tally.codes), "refused:", dict(tally.refusals))
    assert tally.problems == []
    assert tally.codes["Generate:OK"] > 0, "no fuzzed request got as far as generating"
    assert_after(stack, baseline)


async def _code(call: Any) -> Outcome:
    outcome, _ = await call
    return outcome


def test_fuzzed_internal_requests(stack: Stack, baseline: list[str]) -> None:
    where = addresses(stack)
    prefill, decode, store = where["prefill-0"], where["decode-0"], where["blockstore"]
    overrides = {
        **COMMON,
        "pdserve.prefill.v1.PrefillRequest.prompt_token_ids": _TOKEN,
        "pdserve.decode.v1.DecodeRequest.prompt_token_ids": _TOKEN,
        "pdserve.decode.v1.DecodeRequest.generated_token_ids": _TOKEN,
        "pdserve.common.v1.KvHandle.producer_address": st.sampled_from(
            [prefill, decode, "127.0.0.1:1", ""]
        ),
        "pdserve.common.v1.KvHandle.model": st.sampled_from(["", stack.model_dir.name]),
        "pdserve.common.v1.KvHandle.hash_scheme_version": st.sampled_from([0, 1, 2]),
        "pdserve.prefill.v1.PrefillRequest.request_id": _ID,
        "pdserve.decode.v1.DecodeRequest.request_id": _ID,
        "pdserve.kv.v1.PullBlocksRequest.lease_id": _ID,
        "pdserve.kv.v1.PullBlocksRequest.request_id": _ID,
    }
    tally = Tally()

    good = common_pb2.SamplingParams(max_tokens=2)

    @examples(60)
    @example(  # well-formed, run every time (see test_fuzzed_gateway_requests)
        prefill_pb2.PrefillRequest(
            request_id="fuzz-good", prompt_token_ids=[1, 2, 3, 4], sampling=good
        ),
        decode_pb2.DecodeRequest(
            request_id="fuzz-good",
            prompt_token_ids=[1, 2, 3, 4],
            sampling=good,
            local_prefill=True,
        ),
        kv_transfer_pb2.PullBlocksRequest(lease_id="none", request_id="fuzz-good"),
        kv_transfer_pb2.ReleaseLeaseRequest(lease_id="none"),
        True,
    )
    @given(
        messages(prefill_pb2.PrefillRequest, overrides, REQUIRED),
        messages(decode_pb2.DecodeRequest, overrides, REQUIRED),
        messages(kv_transfer_pb2.PullBlocksRequest, overrides, REQUIRED),
        messages(kv_transfer_pb2.ReleaseLeaseRequest, overrides),
        st.booleans(),
    )
    def fuzz(
        prefill_request: prefill_pb2.PrefillRequest,
        decode_request: decode_pb2.DecodeRequest,
        pull: kv_transfer_pb2.PullBlocksRequest,
        release: kv_transfer_pb2.ReleaseLeaseRequest,
        pull_from_prefill: bool,
    ) -> None:
        async def on_prefill() -> Outcome:
            async with grpc.aio.insecure_channel(prefill) as channel:
                outcome, response = await unary(
                    prefill_pb2_grpc.PrefillServiceStub(channel).Prefill, prefill_request
                )
                if response is not None and response.kv_handle.lease_id:
                    # Its consumer (us) hands the lease back, as the gateway does.
                    await kv_transfer_pb2_grpc.KvTransferServiceStub(channel).ReleaseLease(
                        kv_transfer_pb2.ReleaseLeaseRequest(lease_id=response.kv_handle.lease_id)
                    )
                return outcome

        async def on_decode() -> Outcome:
            async with grpc.aio.insecure_channel(decode) as channel:
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
                return await streamed(stub.Decode(decode_request, timeout=CALL_TIMEOUT_S))

        async def on_transfer(target: str) -> Outcome:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
                outcome = await streamed(stub.PullBlocks(pull, timeout=CALL_TIMEOUT_S))
                if outcome[0] in FORBIDDEN:
                    return outcome
                return (await unary(stub.ReleaseLease, release))[0]

        timed(tally, "Prefill", prefill_request, on_prefill)
        timed(tally, "Decode", decode_request, on_decode)
        target = prefill if pull_from_prefill else decode
        timed(tally, "KvTransfer", (pull, release), lambda: on_transfer(target))

    fuzz()
    print("internal fuzz:", dict(tally.codes), "refused:", dict(tally.refusals))
    assert tally.problems == []
    assert tally.codes["Prefill:OK"] > 0 and tally.codes["Decode:OK"] > 0
    # The block store, unary calls and the client stream of PutBlocks.
    store_tally = fuzz_block_store(store, overrides)
    print("block store fuzz:", dict(store_tally.codes))
    assert store_tally.problems == []
    assert_after(stack, baseline)


def fuzz_block_store(store: str, overrides: dict[str, Any]) -> Tally:
    tally = Tally()
    unaries = [
        ("BeginPut", block_store_pb2.BeginPutRequest),
        ("CommitPut", block_store_pb2.CommitPutRequest),
        ("AbortPut", block_store_pb2.AbortPutRequest),
        ("ContainsBlocks", block_store_pb2.ContainsBlocksRequest),
        ("GetStatus", block_store_pb2.GetStatusRequest),
    ]

    @examples(40)
    @given(
        st.tuples(*(messages(cls, overrides) for _, cls in unaries)),
        messages(block_store_pb2.GetBlocksRequest, overrides),
        st.lists(messages(block_store_pb2.PutBlocksRequest, overrides), max_size=4),
    )
    def fuzz(
        requests: tuple[Any, ...],
        get: block_store_pb2.GetBlocksRequest,
        puts: list[block_store_pb2.PutBlocksRequest],
    ) -> None:
        async def body(call: Callable[[block_store_pb2_grpc.BlockStoreServiceStub], Any]) -> Any:
            async with grpc.aio.insecure_channel(store) as channel:
                return await call(block_store_pb2_grpc.BlockStoreServiceStub(channel))

        for (name, _), request in zip(unaries, requests, strict=True):
            timed(tally, name, request, lambda n=name, r=request: body(
                lambda stub: _code(unary(getattr(stub, n), r))))  # fmt: skip
        timed(tally, "GetBlocks", get, lambda: body(
            lambda stub: streamed(stub.GetBlocks(get, timeout=CALL_TIMEOUT_S))))  # fmt: skip
        timed(tally, "PutBlocks", puts, lambda: body(
            lambda stub: client_stream(stub.PutBlocks, puts)))  # fmt: skip

    fuzz()
    return tally


def assert_after(stack: Stack, baseline: list[str]) -> None:
    """Every KV block free again, every process alive and healthy, no ERROR logged."""
    assert_everything_free(stack)
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None and len(state.alive()) == len(state.children)
    assert server_faults(stack) == baseline

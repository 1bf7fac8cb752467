"""One request is one trace across the gateway, prefill, KV pull and decode processes,
inside the trace of a client that sent its own ``traceparent``."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import urllib.request

import grpc
import pytest

from common.rpc.channels import create_channel
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.conftest import ObservedStack
from tests.telemetry.otlp_receiver import CLIENT, INTERNAL, SERVER, ReceivedSpan

pytestmark = pytest.mark.slow

PREFILL = "pdserve.prefill.v1.PrefillService/Prefill"
DECODE = "pdserve.decode.v1.DecodeService/Decode"
PULL = "pdserve.kv.v1.KvTransferService/PullBlocks"
MAX_TOKENS = 6


def generate(
    stack: ObservedStack,
    request: gateway_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...],
) -> list[gateway_pb2.GenerateResponse]:
    async def run() -> list[gateway_pb2.GenerateResponse]:
        channel = create_channel(stack.target)
        try:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            return [m async for m in stub.Generate(request, metadata=metadata, timeout=120)]
        finally:
            await channel.close()

    return asyncio.run(run())


def one(spans: list[ReceivedSpan], service: str, name: str, kind: int) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name and s.kind == kind]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def test_a_request_is_one_trace_inside_the_clients(observed_stack: ObservedStack) -> None:
    stack = observed_stack
    model = stack.model_dir.name
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    prompt = [random.Random(5).randrange(1000, 40000) for _ in range(100)]  # 6 full blocks
    request = gateway_pb2.GenerateRequest(
        request_id="trace-req-1",
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9, seed=7, ignore_eos=True
        ),
    )
    responses = generate(stack, request, (("traceparent", f"00-{trace_id}-{client_span_id}-01"),))
    final = responses[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == MAX_TOKENS

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {(s.service, s.name) for s in spans}
        return {
            ("pdserve-gateway", f"text_completion {model}"),
            ("pdserve-prefill", "prefill"),
            ("pdserve-prefill", PULL),
            ("pdserve-decode", "decode"),
            ("pdserve-decode", DECODE),
        } <= names

    spans = stack.receiver.wait_for(complete, trace_id)
    by_id = {s.span_id: s for s in spans}
    # One trace: every span's parent is in it, but the request span's, which is the client's.
    roots = [s for s in spans if s.parent_span_id not in by_id]
    assert [(r.name, r.parent_span_id) for r in roots] == [
        (f"text_completion {model}", client_span_id)
    ]
    assert {s.service for s in spans} >= {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}

    gateway = "pdserve-gateway"
    root = roots[0]
    assert root.kind == SERVER
    tokenize = one(spans, gateway, "tokenize", INTERNAL)
    route = one(spans, gateway, "route", INTERNAL)
    prefill_call = one(spans, gateway, PREFILL, CLIENT)
    decode_call = one(spans, gateway, DECODE, CLIENT)
    for child in (tokenize, route, prefill_call, decode_call):
        assert child.parent_span_id == root.span_id, child.name
    prefill_rpc = one(spans, "pdserve-prefill", PREFILL, SERVER)
    prefill = one(spans, "pdserve-prefill", "prefill", INTERNAL)
    decode_rpc = one(spans, "pdserve-decode", DECODE, SERVER)
    transfer = one(spans, "pdserve-decode", "kv_transfer", CLIENT)
    pull = one(spans, "pdserve-prefill", PULL, SERVER)
    decode = one(spans, "pdserve-decode", "decode", INTERNAL)
    assert prefill_rpc.parent_span_id == prefill_call.span_id
    assert prefill.parent_span_id == prefill_rpc.span_id
    assert decode_rpc.parent_span_id == decode_call.span_id
    assert transfer.parent_span_id == decode_rpc.span_id
    assert pull.parent_span_id == transfer.span_id  # decode -> producer, across processes
    assert decode.parent_span_id == decode_rpc.span_id
    assert prefill_call.end_ns <= decode_call.start_ns

    # The request span: GenAI conventions, routing decision and reason.
    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == model
    assert attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.usage.input_tokens"] == len(prompt)
    assert attrs["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.id"] == "trace-req-1"
    assert attrs["pdserve.route.reason"] == "load"  # nobody holds any of a fresh prompt
    assert attrs["pdserve.route.prefill_worker_id"] == "prefill-0"
    assert attrs["pdserve.route.decode_worker_id"] == "decode-0"
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert route.attributes["pdserve.route.reason"] == "load"
    assert route.attributes["pdserve.route.num_prompt_blocks"] == 6
    assert tokenize.attributes["pdserve.num_tokens"] == len(prompt)

    # Prefill: cached vs computed tokens.
    assert prefill.attributes["pdserve.cached_tokens"] == final.usage.cached_tokens == 0
    assert prefill.attributes["pdserve.computed_tokens"] == len(prompt)
    assert prefill.attributes["pdserve.finish_reason"] == "prefilled"
    assert prefill.attributes["pdserve.queue_ms"] >= 0

    # The KV transfer: 7 blocks (6 full + the partial one) in one chunk, bytes and rate.
    kv = transfer.attributes
    assert kv["pdserve.kv.source"] == "producer"
    assert kv["pdserve.kv.blocks"] == 7
    assert kv["pdserve.kv.chunks"] >= 1
    assert kv["pdserve.kv.bytes"] > 0 and kv["pdserve.kv.bytes"] % 7 == 0
    assert kv["pdserve.kv.duration_ms"] > 0
    assert kv["pdserve.kv.gbps"] == pytest.approx(
        kv["pdserve.kv.bytes"] / (kv["pdserve.kv.duration_ms"] / 1000) / 1e9
    )

    # Decode: its queue time and the tokens it generated (the first came from prefill).
    assert decode.attributes["pdserve.tokens_generated"] == MAX_TOKENS - 1
    assert decode.attributes["pdserve.queue_ms"] >= 0
    assert decode.attributes["pdserve.kv.source"] == "producer"
    assert decode.attributes["pdserve.finish_reason"] == "length"

    # Each process's log has the request's line, with the trace and request ids.
    for name, text in (
        ("gateway", "request trace-req-1: length"),
        ("prefill-0", "prefill trace-req-1: prefilled"),
        ("decode-0", "decode trace-req-1: length"),
    ):
        lines = [line for line in stack.log_of(name).splitlines() if text in line]
        assert len(lines) == 1, (name, lines)
        assert f"[trace_id={trace_id} request_id=trace-req-1]" in lines[0]


def test_without_a_client_trace_the_gateway_starts_one(observed_stack: ObservedStack) -> None:
    stack = observed_stack
    request = gateway_pb2.GenerateRequest(
        request_id="trace-req-2",
        raw_prompt="Hello",  # short: the decode worker prefills it
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
    )
    generate(stack, request, ())

    def request_root(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
        return next(
            (s for s in spans if s.attributes.get("gen_ai.response.id") == "trace-req-2"), None
        )

    def complete(spans: list[ReceivedSpan]) -> bool:
        root = request_root(spans)
        return root is not None and any(
            s.trace_id == root.trace_id and s.name == "decode" for s in spans
        )

    spans = stack.receiver.wait_for(complete)
    root = request_root(spans)
    assert root is not None and root.parent_span_id == ""
    assert root.attributes["pdserve.route.reason"] == "local_prefill_short"
    assert "pdserve.route.prefill_worker_id" in root.attributes
    in_trace = [s for s in spans if s.trace_id == root.trace_id]
    decode = next(s for s in in_trace if s.name == "decode")
    assert decode.attributes["pdserve.local_prefill"] is True
    assert {s.service for s in in_trace} >= {"pdserve-gateway", "pdserve-decode"}
    assert not any(s.service == "pdserve-prefill" for s in in_trace)


def test_an_http_request_joins_the_clients_trace_too(observed_stack: ObservedStack) -> None:
    """The OpenAI-compatible API: its server span is the client's child, and the request
    span (the same GenAI attributes as for gRPC) and the workers' spans sit under it."""
    stack = observed_stack
    model = stack.model_dir.name
    trace_id, client_span_id = secrets.token_hex(16), secrets.token_hex(8)
    prompt = " ".join(f"word{i}" for i in range(40))  # long enough for a prefill worker
    request = urllib.request.Request(
        f"{stack.http_url()}/completions",
        data=json.dumps({"prompt": prompt, "max_tokens": 3, "ignore_eos": True}).encode(),
        headers={"traceparent": f"00-{trace_id}-{client_span_id}-01"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        assert json.loads(reply.read())["usage"]["completion_tokens"] == 3

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = {(s.service, s.name) for s in spans}
        return {
            ("pdserve-gateway", "POST /v1/completions"),
            ("pdserve-gateway", f"text_completion {model}"),
            ("pdserve-decode", "decode"),
        } <= names

    spans = stack.receiver.wait_for(complete, trace_id)
    http = one(spans, "pdserve-gateway", "POST /v1/completions", SERVER)
    assert http.parent_span_id == client_span_id
    assert http.attributes["http.response.status_code"] == 200
    generation = one(spans, "pdserve-gateway", f"text_completion {model}", INTERNAL)
    assert generation.parent_span_id == http.span_id
    assert generation.attributes["gen_ai.usage.output_tokens"] == 3
    assert generation.attributes["gen_ai.response.finish_reasons"] == ["length"]
    decode_call = one(spans, "pdserve-gateway", DECODE, CLIENT)
    assert decode_call.parent_span_id == generation.span_id
    decode_rpc = one(spans, "pdserve-decode", DECODE, SERVER)
    assert decode_rpc.parent_span_id == decode_call.span_id

"""A stream survives its gateway: a gateway of the stack is SIGKILLed mid-stream and the
client resumes on another gateway (GenerateRequest.resume) with the tokens it received;
the stream goes on with exactly the tokens the unbroken one produces, the old decode
worker frees the orphaned request, and a resume is bound to its caller."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import grpc
import pytest

from common.contract.sampling import SamplingParams
from pdserve.client import GatewayClient
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2
from tests.integration.conftest import Stack, extra_gateway
from tests.polling import settle

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 64
KILL_AFTER = 16
BLOCK = 16  # the stack's KV block size (the default)


async def stream(target: str, sampling: SamplingParams, salt: str = "",
                 resume: gateway_pb2.ResumeFrom | None = None,
                 stop_after: int | None = None) -> list[gateway_pb2.GenerateResponse]:  # fmt: skip
    """The messages of one Generate call; with ``stop_after``, those until that many tokens
    came (the call is then left for the caller to break)."""
    client = GatewayClient(target)
    request = gateway_pb2.GenerateRequest(prompt=PROMPT, cache_salt=salt)
    sampling.to_pb(request.sampling)
    if resume is not None:
        request.resume.CopyFrom(resume)
    messages: list[gateway_pb2.GenerateResponse] = []
    try:
        call = client.stub.Generate(request, timeout=120)
        async for message in call:
            messages.append(message)
            if stop_after is not None and sum(len(m.token_ids) for m in messages) >= stop_after:
                return messages
    finally:
        await client.close()
    return messages


def recomputed_tokens(stack: Stack) -> float:
    """The first gateway's pdserve:resume_recomputed_tokens_total."""
    with urllib.request.urlopen(stack.http_url().removesuffix("/v1") + "/metrics") as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith("pdserve:resume_recomputed_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no pdserve:resume_recomputed_tokens_total on the gateway")


def tokens_of(messages: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def text_of(messages: list[gateway_pb2.GenerateResponse]) -> str:
    return "".join(m.text for m in messages)


def resume_from(messages: list[gateway_pb2.GenerateResponse]) -> gateway_pb2.ResumeFrom:
    return gateway_pb2.ResumeFrom(
        resume_token=messages[-1].resume_token, token_ids=tokens_of(messages)
    )


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_a_stream_resumes_on_another_gateway_after_its_own_is_killed(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory, sampling: SamplingParams
) -> None:
    reference = asyncio.run(stream(stack.target, sampling))
    assert len(tokens_of(reference)) == MAX_TOKENS
    assert all(m.resume_token for m in reference)
    with extra_gateway(stack, tmp_path_factory, "gateway-doomed") as doomed:
        received = asyncio.run(stream(doomed.child.address, sampling, stop_after=KILL_AFTER))
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=30)
    before = recomputed_tokens(stack)
    resumed = asyncio.run(stream(stack.target, sampling, resume=resume_from(received)))
    assert tokens_of(received) + tokens_of(resumed) == tokens_of(reference)
    assert text_of(received) + text_of(resumed) == text_of(reference)
    last = resumed[-1]
    assert last.finish_reason == reference[-1].finish_reason
    assert last.usage.completion_tokens == MAX_TOKENS
    # The continuation recomputed only the context's last block: the rest (the prompt and
    # the full blocks of tokens sent) was still in its decode worker's prefix cache.
    context = last.usage.prompt_tokens + len(tokens_of(received))
    assert recomputed_tokens(stack) - before == context - BLOCK * ((context - 1) // BLOCK)
    # The killed gateway's decode call ended with its connection: nothing stays held.
    stack.wait_all_free()


def test_a_finished_request_resumed_returns_its_end_and_generates_nothing(stack: Stack) -> None:
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = asyncio.run(stream(stack.target, sampling))
    tokens = tokens_of(whole)
    cut = next(i for i in range(1, len(whole)) if len(tokens_of(whole[:i])) >= 5)
    resume = gateway_pb2.ResumeFrom(resume_token=whole[cut - 1].resume_token,
                                    token_ids=tokens_of(whole[:cut]))  # fmt: skip
    end = asyncio.run(stream(stack.target, sampling, resume=resume))
    assert len(end) == 1 and tokens_of(whole[:cut]) + list(end[0].token_ids) == tokens
    assert text_of(whole[:cut]) + end[0].text == text_of(whole)
    assert end[0].finish_reason == whole[-1].finish_reason
    assert end[0].usage.completion_tokens == len(tokens)


def call_error(coroutine: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(coroutine)
    return error.value


def test_a_resume_is_refused_for_strangers_and_for_altered_tokens(stack: Stack) -> None:
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    whole = asyncio.run(stream(stack.target, sampling, salt="tenant-resume"))
    tokens = tokens_of(whole)
    token = whole[-1].resume_token
    # Another cache salt (another tenant's), an unknown request: NOT_FOUND alike.
    foreign = call_error(stream(stack.target, sampling, salt="tenant-b",
                                resume=gateway_pb2.ResumeFrom(resume_token=token,
                                                              token_ids=tokens[:3])))  # fmt: skip
    unknown = call_error(stream(stack.target, sampling, salt="tenant-resume",
                                resume=gateway_pb2.ResumeFrom(resume_token=f"{'0' * 32}.3",
                                                              token_ids=tokens[:3])))  # fmt: skip
    assert foreign.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
    assert foreign.details() == unknown.details()
    altered = [*tokens[:4], (tokens[4] + 1) % 1000, *tokens[5:7]]
    mismatch = call_error(stream(stack.target, sampling, salt="tenant-resume",
                                 resume=gateway_pb2.ResumeFrom(resume_token=token,
                                                               token_ids=altered)))  # fmt: skip
    assert mismatch.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume.token_ids" in mismatch.details() and "position 4" in mismatch.details()
    garbage = call_error(stream(stack.target, sampling, salt="tenant-resume",
                                resume=gateway_pb2.ResumeFrom(resume_token="nonsense")))  # fmt: skip
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_client_resumes_on_its_next_target_by_itself(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = asyncio.run(stream(stack.target, sampling))

    async def through(targets: str, kill: Any) -> tuple[list[gateway_pb2.GenerateResponse], int]:
        client = GatewayClient(targets)
        messages: list[gateway_pb2.GenerateResponse] = []
        try:
            async for message in client.generate(prompt=PROMPT, sampling=sampling,
                                                 timeout_s=120):  # fmt: skip
                messages.append(message)
                if len(tokens_of(messages)) >= KILL_AFTER:
                    kill()
        finally:
            await client.close()
        return messages, client.num_resumes

    with extra_gateway(stack, tmp_path_factory, "gateway-doomed-2") as doomed:

        def kill() -> None:
            if doomed.process.poll() is None:
                doomed.process.send_signal(signal.SIGKILL)
                doomed.process.wait(timeout=30)

        messages, resumes = asyncio.run(through(f"{doomed.child.address},{stack.target}", kill))
    assert resumes == 1
    assert tokens_of(messages) == tokens_of(reference)
    assert text_of(messages) == text_of(reference)
    stack.wait_all_free()


def test_pdserve_generate_with_two_targets_survives_the_first(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = ["--json", "--max-tokens", "160", "--ignore-eos", PROMPT]
    reference = stack.cli("generate", "--target", stack.target, *args)
    assert reference.returncode == 0, reference.stderr
    with extra_gateway(stack, tmp_path_factory, "gateway-doomed-3") as doomed:
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "generate", "--target",
             f"{doomed.child.address},{stack.target}", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=stack.env,
        )  # fmt: skip
        # Killed once its stream runs: its decode worker holds the request.
        settle(lambda: [w["running"] for w in stack.workers() if w["role"] == "decode"],
               lambda running: sum(running) > 0, 60.0)  # fmt: skip
        doomed.process.send_signal(signal.SIGKILL)
        out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    mine, theirs = json.loads(out), json.loads(reference.stdout)
    assert mine["token_ids"] == theirs["token_ids"] and mine["text"] == theirs["text"]
    stack.wait_all_free()


async def sse(url: str, body: dict[str, Any], last_event_id: str | None = None,
              stop_after: int | None = None) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
    """The (id, data) of each server-sent event of one POST; with ``stop_after``, those until
    that many chunks came (the connection is then dropped)."""
    import aiohttp

    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events: list[tuple[str, dict[str, Any]]] = []
    event_id = ""
    async with aiohttp.ClientSession() as session, session.post(
        url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=120)
    ) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                events.append((event_id, json.loads(line[6:])))
                if stop_after is not None and len(events) >= stop_after:
                    return events
    return events


def sse_texts(events: list[tuple[str, dict[str, Any]]], n: int) -> list[str]:
    texts = [""] * n
    for _, data in events:
        for choice in data["choices"]:
            delta = choice.get("delta")
            texts[choice["index"]] += (delta or {}).get("content") or choice.get("text") or ""
    return texts


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_an_sse_stream_reconnects_with_last_event_id_on_another_gateway(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory, endpoint: str
) -> None:
    n = 1 if endpoint == "completions" else 2
    body: dict[str, Any] = {
        "model": stack.model_dir.name, "max_tokens": 48, "temperature": 0.7, "seed": 7,
        "ignore_eos": True, "stream": True, "n": n,
    }  # fmt: skip
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    reference = asyncio.run(sse(f"{stack.http_url()}/{endpoint}", body))
    assert all(event_id for event_id, data in reference if data["choices"])
    with extra_gateway(stack, tmp_path_factory, f"gateway-sse-{n}") as doomed:
        url = f"http://127.0.0.1:{doomed.http_port}/v1/{endpoint}"
        before = asyncio.run(sse(url, body, stop_after=12))
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=30)
    last_id = before[-1][0]
    after = asyncio.run(sse(f"{stack.http_url()}/{endpoint}", body, last_event_id=last_id))
    assert {data["id"] for _, data in before + after} == {last_id.split(";")[0]}
    joined = [a + b for a, b in zip(sse_texts(before, n), sse_texts(after, n), strict=True)]
    assert joined == sse_texts(reference, n)
    finishes = [c["finish_reason"] for _, d in after for c in d["choices"] if c["finish_reason"]]
    assert sorted(finishes) == ["length"] * n
    stack.wait_all_free()


def test_the_openai_sdk_reads_one_stream_through_a_gateways_death(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """AsyncOpenAI on pdserve.sse_resume's transport: the gateway it streams from is
    SIGKILLed mid-stream, and the SDK's one iterator goes on from the other gateway."""
    import httpx2
    import openai

    from pdserve.sse_resume import AsyncResumingTransport

    messages = [{"role": "user", "content": PROMPT}]
    extra = {"ignore_eos": True}

    async def chat(base: str, gateways: list[str], kill: Any = None) -> tuple[str, str, int]:
        transport = AsyncResumingTransport(gateways)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport))  # fmt: skip
        text, finish, chunks = "", "", 0
        try:
            stream = await client.chat.completions.create(
                model=stack.model_dir.name, messages=messages, max_tokens=120, temperature=0,
                stream=True, extra_body=extra,
            )  # fmt: skip
            async for chunk in stream:
                chunks += 1
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if kill is not None and chunks == 10:
                    kill()
        finally:
            await client.close()
        return text, finish, transport.num_resumes

    main = stack.http_url().removesuffix("/v1")
    reference, finish, _ = asyncio.run(chat(main, [main]))
    assert finish == "length" and reference
    with extra_gateway(stack, tmp_path_factory, "gateway-sdk") as doomed:
        first = f"http://127.0.0.1:{doomed.http_port}"
        text, finish, resumes = asyncio.run(
            chat(first, [first, main], kill=lambda: doomed.process.send_signal(signal.SIGKILL))
        )
    assert resumes == 1
    assert finish == "length" and text == reference
    stack.wait_all_free()


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}  # fmt: skip


def test_a_json_schema_stream_resumed_mid_output_stays_valid_and_identical(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The grammar state replays the tokens sent before the break: the continuation is the
    undisturbed stream's, and the whole is JSON the schema accepts."""
    import jsonschema

    from common.contract.structured import ConstraintKind, StructuredOutput

    sampling = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=77,
        structured_output=StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON)),
    )  # fmt: skip
    reference = asyncio.run(stream(stack.target, sampling))
    assert reference[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert len(tokens_of(reference)) > 12  # long enough to break in the middle
    with extra_gateway(stack, tmp_path_factory, "gateway-doomed-json") as doomed:
        received = asyncio.run(stream(doomed.child.address, sampling, stop_after=8))
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=30)
    resumed = asyncio.run(stream(stack.target, sampling, resume=resume_from(received)))
    assert tokens_of(received) + tokens_of(resumed) == tokens_of(reference)
    whole = text_of(received) + text_of(resumed)
    assert whole == text_of(reference)
    jsonschema.validate(json.loads(whole), PERSON)
    stack.wait_all_free()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip


def without_ids(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each chunk's choices, less what differs between runs (ids, created)."""
    out = []
    for _, data in events:
        for choice in data["choices"]:
            choice = json.loads(json.dumps(choice))
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                call.pop("id", None)
            out.append(choice)
    return out


@pytest.mark.parametrize("case", ["forced_tool_call", "logprobs"])
def test_a_resumed_sse_stream_ends_as_the_undisturbed_one(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory, case: str
) -> None:
    """What the server builds from all of a choice's text (a forced tool call, sent whole
    with the last chunk) and text_offset, which counts the characters before each token,
    come out after a resume as they do undisturbed."""
    model = stack.model_dir.name
    if case == "forced_tool_call":
        endpoint, stop_after = "chat/completions", 6
        body: dict[str, Any] = {
            "model": model, "stream": True, "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }  # fmt: skip
    else:
        endpoint, stop_after = "completions", 10
        body = {"model": model, "stream": True, "max_tokens": 30, "temperature": 0,
                "ignore_eos": True, "prompt": PROMPT, "logprobs": 2}  # fmt: skip
    reference = asyncio.run(sse(f"{stack.http_url()}/{endpoint}", body))
    with extra_gateway(stack, tmp_path_factory, f"gateway-sse-{case}") as doomed:
        url = f"http://127.0.0.1:{doomed.http_port}/v1/{endpoint}"
        before = asyncio.run(sse(url, body, stop_after=stop_after))
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=30)
    after = asyncio.run(sse(f"{stack.http_url()}/{endpoint}", body, last_event_id=before[-1][0]))
    assert without_ids(before + after) == without_ids(reference)
    if case == "forced_tool_call":
        last = without_ids(after)[-1]
        assert last["finish_reason"] == "tool_calls"
        arguments = json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"])
        assert set(arguments) == {"city", "unit"}
    else:
        offsets = [o for c in without_ids(before + after) for o in c["logprobs"]["text_offset"]]
        assert offsets == sorted(offsets) and len(offsets) == 30
    stack.wait_all_free()

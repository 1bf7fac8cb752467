"""The gateway's OpenAI-compatible HTTP API, driven by the real ``openai`` SDK (sync and
async), by ``curl`` and by a raw HTTP client, against the shared stack (2 prefill, 2 decode)
and, for keys, admission and draining, a second gateway process on the same workers.

- greedy output through HTTP equals the gRPC API's, token for token, streamed or not, for
  completions and chat;
- streaming: SSE chunks that add up to the non-streamed answer, ``[DONE]`` last, usage in
  a last chunk with ``stream_options.include_usage``;
- ``n`` copies: seeded, reproducible, different from each other, and the later copies reuse
  the first copy's prompt KV (cached tokens in the gateway's request log);
- logprobs: completions (``logprobs: k``, ``echo`` with the prompt's), chat
  (``top_logprobs``), consistent with the gRPC API's;
- errors: 400, 401, 404, 429 with ``Retry-After``, 503 while draining, in OpenAI's JSON;
- a client that disconnects mid-stream frees every KV block.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from common.contract.sampling import SamplingParams
from pdserve.cli.launcher import Child, StackState
from pdserve.client import GatewayClient
from tests.integration.conftest import Stack, extra_gateway
from tests.integration.test_cancellation import assert_everything_free
from tests.polling import until

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a planet of the solar system."}]
MAX_TOKENS = 12
KEY = "openai-test-key"


def sync_client(stack: Stack, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url(), api_key="unused", max_retries=0, **kwargs)


def grpc_greedy(stack: Stack, **request: object) -> tuple[list[int], str]:
    async def run() -> tuple[list[int], str]:
        client = GatewayClient(stack.target)
        try:
            result = await client.complete(
                sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), **request
            )
        finally:
            await client.close()
        return result.token_ids, result.text

    return asyncio.run(run())


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> dict:
        return json.loads(self.body)


def http(url: str, body: dict | bytes | None = None, headers: dict[str, str] | None = None,
         timeout_s: float = 30.0) -> Reply:  # fmt: skip
    """One plain HTTP request (POST when there is a body); errors are replies too."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Reply(response.status, response.read(), dict(response.headers))
    except urllib.error.HTTPError as error:
        return Reply(error.code, error.read(), dict(error.headers))


def test_models_lists_the_served_model(stack: Stack) -> None:
    models = sync_client(stack).models.list()
    assert [m.id for m in models.data] == [stack.model_dir.name]
    assert models.data[0].owned_by == "pdserve"


def test_greedy_completion_equals_the_grpc_api_streamed_or_not(stack: Stack) -> None:
    ids, text = grpc_greedy(stack, raw_prompt=PROMPT)
    client = sync_client(stack)
    reply = client.completions.create(
        model=stack.model_dir.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert reply.choices[0].text == text
    assert reply.usage is not None and reply.usage.completion_tokens == len(ids)
    assert reply.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(
        model=stack.model_dir.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True,
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    # Token ids in, the same tokens out.
    by_ids = client.completions.create(
        model=stack.model_dir.name, prompt=ids[:4], max_tokens=4, temperature=0.0
    )
    ids_text = grpc_greedy(stack, token_ids=ids[:4])[1]
    assert by_ids.choices[0].text.startswith(ids_text[:4])


def test_greedy_chat_equals_the_grpc_api_and_streams_with_usage(stack: Stack) -> None:
    ids, text = grpc_greedy(stack, messages=CHAT)

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=stack.http_url(), api_key="x", max_retries=0)
        reply = await client.chat.completions.create(
            model=stack.model_dir.name, messages=CHAT, max_completion_tokens=MAX_TOKENS,
            temperature=0.0,
        )  # fmt: skip
        assert reply.choices[0].message.content == text
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage is not None and reply.usage.completion_tokens == len(ids)
        stream = await client.chat.completions.create(
            model=stack.model_dir.name, messages=CHAT, max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        await client.close()
        content = [c for c in chunks if c.choices]
        assert content[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in content) == text
        assert content[-1].choices[0].finish_reason is not None
        assert all(c.usage is None for c in content)
        usage = chunks[-1].usage
        assert not chunks[-1].choices and usage is not None
        assert usage.completion_tokens == len(ids)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    asyncio.run(run())


def test_n_copies_are_seeded_and_reuse_the_first_copys_prompt_kv(stack: Stack) -> None:
    client = sync_client(stack)
    prompt = "Once upon a time, in a kingdom by the sea, there lived an old fisherman who"
    salt = f"n-copies-{time.time_ns()}"

    def ask() -> openai.types.Completion:
        return client.completions.create(
            model=stack.model_dir.name, prompt=prompt, max_tokens=8, n=3, seed=11,
            temperature=1.0, extra_body={"cache_salt": salt},
        )  # fmt: skip

    first, again = ask(), ask()
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]  # seed + copy: reproducible
    assert len(set(texts)) > 1  # ...and the copies differ
    assert first.usage is not None
    assert first.usage.completion_tokens == 3 * 8
    log = stack.log_of("gateway")
    cached = {
        int(m[1]): int(m[2])
        for m in re.finditer(
            rf"request {first.id}-(\d+): .* prompt \d+ tokens \((\d+) cached\)", log
        )
    }
    assert sorted(cached) == [0, 1, 2], log[-2000:]
    assert cached[0] == 0  # a fresh salt: nothing cached before
    assert cached[1] >= 16 and cached[2] >= 16, cached  # the first copy's full blocks


def test_min_tokens_holds_back_a_stop_token_on_the_prefill_worker_too(stack: Stack) -> None:
    """The first token is sampled where the prompt is prefilled: made a stop token, it ends
    the request there, unless min_tokens masks it (prefill and decode workers alike)."""
    ids, _ = grpc_greedy(stack, raw_prompt=PROMPT)
    client = sync_client(stack)

    def ask(min_tokens: int) -> openai.types.Completion:
        return client.completions.create(
            model=stack.model_dir.name, prompt=PROMPT, max_tokens=6, temperature=0.0,
            extra_body={"stop_token_ids": [ids[0]], "min_tokens": min_tokens},
        )  # fmt: skip

    stopped, held = ask(0), ask(4)
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].finish_reason == "stop"
    assert held.usage is not None and held.usage.completion_tokens >= 4


def test_logprobs_and_echo(stack: Stack) -> None:
    client = sync_client(stack)
    reply = client.completions.create(
        model=stack.model_dir.name, prompt=PROMPT, max_tokens=4, temperature=0.0, logprobs=3,
        echo=True,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    assert all(len(top) <= 3 for top in logprobs.top_logprobs[1:] if top is not None)
    # The sampled (greedy) tokens' logprobs equal the best alternative's.
    for token, lp, top in list(
        zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    )[-4:]:
        assert top is not None and lp == pytest.approx(max(top.values()), abs=1e-5), (token, top)

    chat = client.chat.completions.create(
        model=stack.model_dir.name, messages=CHAT, max_tokens=4, temperature=0.0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == chat.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert bytes(item.bytes or []).decode(errors="replace") == item.token
    assert "".join(item.token for item in content).startswith(chat.choices[0].message.content or "")


def test_max_tokens_zero_echoes_the_prompt_with_its_logprobs_and_generates_nothing(
    stack: Stack,
) -> None:
    client = sync_client(stack)
    with_generation = client.completions.create(
        model=stack.model_dir.name, prompt=PROMPT, max_tokens=1, temperature=0.0, logprobs=2,
        echo=True,
    )  # fmt: skip
    alone = client.completions.create(
        model=stack.model_dir.name, prompt=PROMPT, max_tokens=0, temperature=0.0, logprobs=2,
        echo=True,
    )  # fmt: skip
    choice = alone.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert alone.usage is not None and alone.usage.completion_tokens == 0
    assert alone.usage.prompt_tokens == with_generation.usage.prompt_tokens
    # The prompt's logprobs, exactly those of the same request with one token generated.
    full, mine = with_generation.choices[0].logprobs, choice.logprobs
    assert full is not None and mine is not None
    assert mine.tokens == full.tokens[:-1] and mine.token_logprobs == full.token_logprobs[:-1]
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=stack.model_dir.name, prompt=PROMPT, max_tokens=0, echo=True, stream=True)
        if chunk.choices
    )  # fmt: skip
    assert streamed == PROMPT
    with pytest.raises(openai.BadRequestError) as nothing:
        client.completions.create(model=stack.model_dir.name, prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in nothing.value.message and "echo" in nothing.value.message


def test_bad_requests_get_openai_errors(stack: Stack) -> None:
    client = sync_client(stack)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "no-such-model" in missing.value.message
    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model=stack.model_dir.name, prompt="x", temperature=7.0)
    assert hot.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=stack.model_dir.name, prompt="x", max_tokens=10**6)
    assert "max_tokens" in long.value.message
    raw = http(f"{stack.http_url()}/completions", b"{not json")
    assert raw.status == 400
    assert raw.json()["error"]["type"] == "invalid_request_error"


def test_curl_streams_server_sent_events(stack: Stack) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed: run scripts/setup_system.sh")
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    out = subprocess.run(
        [curl, "-sN", f"{stack.http_url()}/completions", "-H", "Content-Type: application/json",
         "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == grpc_greedy(
        stack, raw_prompt=PROMPT
    )[1][: len("".join(c["choices"][0]["text"] for c in chunks))]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_client_that_disconnects_mid_stream_frees_every_block(stack: Stack) -> None:
    async def run() -> int:
        received = 0
        async with aiohttp.ClientSession() as session:
            responses = []
            for i in range(4):
                body = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True,
                        "cache_salt": f"gone-{i}"}  # fmt: skip
                responses.append(
                    await session.post(f"{stack.http_url()}/chat/completions", json=body)
                )
            for response in responses:
                async for line in response.content:
                    if line.startswith(b"data: "):
                        received += 1
                        if received % 3 == 0:
                            break
                response.close()
        return received

    assert asyncio.run(run()) == 12
    assert_everything_free(stack)
    assert re.search(r"request chatcmpl-\w+-0: abort", stack.log_of("gateway"))


def test_http_requests_count_in_the_gateways_metrics(stack: Stack) -> None:
    sync_client(stack).completions.create(
        model=stack.model_dir.name, prompt=PROMPT, max_tokens=1, temperature=0.0
    )
    text = http(stack.http_url().removesuffix("/v1") + "/metrics").body.decode()
    assert re.search(r'pdserve:http_requests_total\{endpoint="completions",status="200"\} [1-9]',
                     text), text[:3000]  # fmt: skip
    assert "pdserve:e2e_request_latency_seconds" in text
    assert http(stack.http_url().removesuffix("/v1") + "/health").status == 200


# -- a second gateway: API keys, admission, draining --------------------------------------


@dataclass
class KeyedGateway:
    child: Child
    process: subprocess.Popen[bytes]
    url: str


@pytest.fixture(scope="module")
def keyed_gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedGateway]:
    """One request in flight at most, one API key, a long drain grace."""
    flags = ("--api-key", KEY, "--max-in-flight", "1", "--drain-grace-s", "60")
    with extra_gateway(stack, tmp_path_factory, "gateway-openai", *flags) as gateway:
        yield KeyedGateway(gateway.child, gateway.process,
                           f"http://127.0.0.1:{gateway.http_port}/v1")  # fmt: skip


def test_keys_and_admission_answer_401_and_429_with_retry_after(
    keyed_gateway: KeyedGateway, stack: Stack
) -> None:
    url, model = keyed_gateway.url, stack.model_dir.name
    for key in ("wrong-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        raw = http(f"{url}/completions", {"prompt": "x"}, headers)
        assert raw.status == 401, raw.body
        assert raw.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [model]

    # One stream holds the only slot; the next request is refused at once.
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices[0].text is not None
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    retry_after = limited.value.response.headers.get("Retry-After")
    assert retry_after is not None and int(retry_after) >= 1
    assert limited.value.body["code"] == "queue_full"
    stream.close()
    until("the slot frees once the stream is closed", lambda: _completes(client, model), 20)


def _completes(client: openai.OpenAI, model: str) -> bool:
    try:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
        return True
    except openai.RateLimitError:
        return False


def test_a_draining_gateway_answers_503_and_finishes_what_it_has(
    keyed_gateway: KeyedGateway, stack: Stack
) -> None:
    """Last in this module: it stops the keyed gateway."""
    url, model = keyed_gateway.url, stack.model_dir.name
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=150, stream=True, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    os.kill(keyed_gateway.child.pid, signal.SIGTERM)
    headers = {"Authorization": f"Bearer {KEY}"}
    health = f"{url.removesuffix('/v1')}/health"
    until("/health answers 503 while draining", lambda: _status(health) == 503, 10, 0.05)
    refused = http(f"{url}/completions", {"prompt": "x"}, headers)
    assert refused.status == 503, refused.body
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    rest = list(chunks)  # the stream in flight finishes
    assert rest[-1].choices[0].finish_reason == "length"
    assert keyed_gateway.process.wait(timeout=30) == 0


def _status(url: str) -> int:
    try:
        return http(url, timeout_s=2).status
    except OSError:  # refused: the gateway is gone
        return 0


def test_the_stack_serves_the_http_api_from_pdserve_up(stack: Stack) -> None:
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None and re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", state.http)
    shown = stack.cli("status", "--target", stack.target)
    assert f"OpenAI-compatible HTTP API at {state.http}" in shown.stdout, shown.stdout
    assert Path(stack.children()["gateway"].log).read_text().count("OpenAI-compatible HTTP") >= 1

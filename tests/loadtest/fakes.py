"""Servers of ours with scripted latencies, for checking that the load tester reports them."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aiohttp import web

from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc

FAIL_TOKEN = 1999  # a prompt starting with this token is refused
FAIL_MIDWAY_TOKEN = 1998  # ... or fails after its first chunk


@dataclass(frozen=True)
class Script:
    """First chunk after ``ttft_s``, then one chunk every ``gap_s``; chunk i carries
    ``tokens[i]`` tokens."""

    ttft_s: float
    gap_s: float
    tokens: tuple[int, ...]
    cached_tokens: int = 0

    @property
    def delays(self) -> list[float]:
        return [self.ttft_s] + [self.gap_s] * (len(self.tokens) - 1)


def sse(payload: object) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def openai_app(script: Script, api_key: str | None = None) -> web.Application:
    """/v1/completions and /v1/chat/completions, streaming the script's chunks; with
    ``api_key``, a request without ``Authorization: Bearer <api_key>`` gets 401."""

    async def stream(request: web.Request) -> web.StreamResponse:
        if api_key is not None and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        body = await request.json()
        chat = "messages" in body
        # Chat prompts arrive as text: the test's detokenizer writes the ids out as numbers.
        prompt = body.get("prompt") or [int(w) for w in body["messages"][0]["content"].split()]
        if prompt and prompt[0] == FAIL_TOKEN:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if chat:  # vLLM's and llama-server's opening chunk: the role, no token yet
            await response.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
        for i, (delay, count) in enumerate(zip(script.delays, script.tokens, strict=True)):
            await asyncio.sleep(delay)
            # The third token's text waits for a later one (a split character): a token
            # arrives all the same.
            text = "" if i == 2 else "x" * count
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            await response.write(sse({"choices": [choice]}))
            if i == 0 and prompt and prompt[0] == FAIL_MIDWAY_TOKEN:
                await response.write(sse({"error": {"message": "engine died"}}))
                await response.write_eof()
                return response
        last = {"index": 0, "finish_reason": "length"}  # no token: the stream's end
        await response.write(sse({"choices": [
            {**last, "delta": {"content": ""}} if chat else {**last, "text": ""}]}))  # fmt: skip
        await response.write(sse({"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": sum(script.tokens),
            "prompt_tokens_details": {"cached_tokens": script.cached_tokens}}}))  # fmt: skip
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/v1/models", models)
    return app


@contextlib.asynccontextmanager
async def openai_server(script: Script, api_key: str | None = None) -> AsyncIterator[str]:
    runner = web.AppRunner(openai_app(script, api_key))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class ScriptedGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """With ``api_key``, calls without ``authorization: Bearer <api_key>`` get
    UNAUTHENTICATED, as the real gateway answers them."""

    def __init__(self, script: Script, api_key: str | None = None) -> None:
        self.script = script
        self.api_key = api_key
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []  # each Generate call's

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        self.metadata.append(metadata)
        if self.api_key is not None and metadata.get("authorization") != f"Bearer {self.api_key}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        await self._authenticate(context)
        self.requests.append(request)
        ids = list(request.token_ids.ids)
        if ids and ids[0] == FAIL_TOKEN:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        last = len(self.script.tokens) - 1
        for i, (delay, count) in enumerate(
            zip(self.script.delays, self.script.tokens, strict=True)
        ):
            await asyncio.sleep(delay)
            reply = gateway_pb2.GenerateResponse(request_id=request.request_id,
                                                 token_ids=[7] * count, text="x" * count)  # fmt: skip
            if i == last:
                reply.finish_reason = common_pb2.FINISH_REASON_LENGTH
                reply.usage.prompt_tokens = len(ids)
                reply.usage.completion_tokens = sum(self.script.tokens)
                reply.usage.cached_tokens = self.script.cached_tokens
            yield reply
            if i == 0 and ids and ids[0] == FAIL_MIDWAY_TOKEN:
                await context.abort(grpc.StatusCode.INTERNAL, "decode worker lost")

    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        if self.api_key is not None:
            metadata = dict(context.invocation_metadata() or ())
            if metadata.get("authorization") != f"Bearer {self.api_key}":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        return gateway_pb2.GetModelInfoResponse(model="fake", vocab_size=49152, block_size=16)


@contextlib.asynccontextmanager
async def grpc_gateway(
    script: Script, api_key: str | None = None
) -> AsyncIterator[tuple[str, ScriptedGateway]]:
    server = grpc.aio.server()
    servicer = ScriptedGateway(script, api_key)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(None)

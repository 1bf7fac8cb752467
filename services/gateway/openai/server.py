"""The OpenAI-compatible HTTP API, served by aiohttp inside the gateway process.

``/v1/completions`` and ``/v1/chat/completions`` turn a body into GenerateRequests
(convert.py) and run each on ``GatewayServicer.generate``, the request path of the gRPC
API: same admission, tenants, routing, migration and metrics, no extra hop. A request's
``n`` copies of one prompt start after the first copy's first token, so that they route to
where its prompt's KV now is and reuse it. ``/v1/models``, ``/health`` and ``/metrics``
serve the rest; API keys are checked as on the gRPC port (``Authorization: Bearer``).

A client that goes away cancels its handler (``handler_cancellation``), which cancels every
choice's generation: the gateway cancels the decode call, and the worker frees the
sequence's KV at its next step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from common.errors import (
    DrainingError,
    InvalidRequestError,
    PdserveError,
    QueueFullError,
    UnauthenticatedError,
)
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.openai import responses, structured
from services.gateway.openai.convert import (
    chat_requests,
    completion_requests,
    echo_only,
    from_exception,
)
from services.gateway.openai.models import ChatCompletionRequest, CompletionRequest
from services.gateway.openai.responses import Choice, TokenText
from services.gateway.openai.structured import ToolMode
from services.gateway.relay import finish_reason_name
from services.gateway.servicer import GatewayServicer

log = logging.getLogger(__name__)
_DONE = b"data: [DONE]\n\n"


class HttpCall:
    """The HTTP request as the request path reads a gRPC call: its ``authorization``
    header as metadata; no deadline (a client that gives up closes the connection)."""

    def __init__(self, request: web.Request) -> None:
        value = request.headers.get("Authorization")
        self._metadata = () if value is None else (("authorization", value),)
        # A streamed response's client resumes by event id (position) alone: each message's
        # tokens are in the resume record before it goes (GatewayServicer._stamp).
        self.records_before_sending = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None


class _Fanout:
    """One response's GenerateRequests, run at once (a prompt's later copies after its first
    copy's first message); their messages come out of one queue as ``(choice, message)``,
    a failure as ``(choice, exception)``."""

    def __init__(
        self, servicer: GatewayServicer, requests: list[gateway_pb2.GenerateRequest], n: int,
        call: HttpCall,
    ) -> None:  # fmt: skip
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._servicer = servicer
        self._call = call
        self._left = len(requests)
        self._tasks: list[asyncio.Task[None]] = []
        for first in range(0, len(requests), n):
            started = asyncio.Event()  # the prompt's first copy has its first message
            for index in range(first, first + n):
                task = self._run(index, requests[index], started, leads=index == first)
                self._tasks.append(asyncio.create_task(task))

    async def _run(
        self, index: int, request: gateway_pb2.GenerateRequest, started: asyncio.Event,
        leads: bool,
    ) -> None:  # fmt: skip
        """``leads``: the prompt's first copy, which sets ``started``; the others wait for it."""
        try:
            if not leads:
                await started.wait()
            with tracer().start_as_current_span(
                "generate", attributes={"pdserve.choice": index, "pdserve.request_id":
                                        request.request_id},
            ):  # fmt: skip
                generation = self._servicer.generate(request, self._call)
                async with contextlib.aclosing(generation) as messages:
                    async for message in messages:
                        if leads:
                            started.set()
                        self._queue.put_nowait((index, message))
            self._queue.put_nowait((index, None))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
        finally:
            if leads:
                started.set()  # failed before its first message: the copies go on their own

    async def messages(self) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
        """Every message as it comes; raises the first failure."""
        while self._left:
            index, item = await self._queue.get()
            if item is None:
                self._left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@dataclass
class _Endpoint:
    """What differs between the two generation endpoints."""

    body: type[CompletionRequest] | type[ChatCompletionRequest]
    to_requests: Callable[[Any, str], list[gateway_pb2.GenerateRequest]]
    id_prefix: str


_COMPLETIONS = _Endpoint(CompletionRequest, completion_requests, "cmpl")
_CHAT = _Endpoint(ChatCompletionRequest, chat_requests, "chatcmpl")


class OpenAIServer:
    """The HTTP port. ``start`` binds (port 0: a free one) and returns the port."""

    def __init__(self, servicer: GatewayServicer) -> None:
        self.servicer = servicer
        self.token_text = TokenText(servicer.tokenizer)
        self.draining = False
        self.created = int(time.time())
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: web.AppRunner | None = None
        app = web.Application(client_max_size=servicer.config.max_request_bytes)
        app.router.add_get("/v1/models", self._guarded("models", self._models))
        app.router.add_post("/v1/completions", self._guarded("completions", self._completions))
        app.router.add_post("/v1/chat/completions", self._guarded("chat_completions", self._chat))
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.app = app

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, and so its
        # generation. No access log: the request's own log line says more.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(
            runner, host, port, shutdown_timeout=1.0, ssl_context=tls, reuse_port=False
        )
        await site.start()
        self._runner = runner
        server = site._server
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def drain(self, grace_s: float) -> None:
        """New requests get 503 from now on; those in flight get ``grace_s`` to finish."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)

    async def stop(self) -> None:
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- plumbing -------------------------------------------------------------------------

    def _guarded(
        self, endpoint: str, handler: Callable[[web.Request, HttpCall], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:  # fmt: skip
        """The handler behind the draining check, the API key check and a server span that
        joins the client's trace (``traceparent``); every outcome counts in the metrics."""

        async def handle(request: web.Request) -> web.StreamResponse:
            metrics = self.servicer.metrics
            status = 499  # what counts when the client goes away first (nginx's code for it)
            self._in_flight += 1
            self._idle.clear()
            with tracer().start_as_current_span(
                f"{request.method} {request.path}",
                context=propagate.extract(dict(request.headers)),
                kind=trace.SpanKind.SERVER,
                attributes={"http.request.method": request.method, "url.path": request.path},
            ) as span:  # fmt: skip
                try:
                    try:
                        response = await handler(request, self._admit(request))
                    except Exception as exc:
                        response = self._error(exc)
                    status = response.status
                    return response
                finally:
                    self._in_flight -= 1
                    if not self._in_flight:
                        self._idle.set()
                    span.set_attribute("http.response.status_code", status)
                    metrics.http_request(endpoint, status)

        return handle

    def _admit(self, request: web.Request) -> HttpCall:
        """The call, unless the gateway is draining or the API key is missing or unknown."""
        call = HttpCall(request)
        if self.draining:
            raise DrainingError("the gateway is shutting down; retry elsewhere")
        keys = self.servicer.config.api_keys
        if keys is not None:
            try:
                keys.tenant_of(call.invocation_metadata())
            except UnauthenticatedError:
                self.servicer.metrics.auth_rejected()
                raise
        return call

    def _error(self, exc: BaseException) -> web.Response:
        status, body = from_exception(exc)
        if status == 500:
            log.error("HTTP request failed: %s", exc, exc_info=exc)
        headers = {}
        if isinstance(exc, QueueFullError) and exc.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_ms / 1000)))
        return web.json_response(body, status=status, headers=headers)

    async def _parse(self, request: web.Request, model: type[BaseModel]) -> Any:
        raw = await request.read()
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            if any(e["type"] == "json_invalid" for e in exc.errors()):
                raise _BadJson(exc.errors()[0]["msg"]) from exc
            raise

    # -- endpoints ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.servicer.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request, call: HttpCall) -> web.Response:
        limit = await self.servicer.context_limit()
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.servicer.model,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "pdserve",
                        "root": self.servicer.model,
                        "max_model_len": limit,
                    }
                ],
            }
        )

    async def _completions(self, request: web.Request, call: HttpCall) -> web.StreamResponse:
        return await self._generate(request, call, _COMPLETIONS)

    async def _chat(self, request: web.Request, call: HttpCall) -> web.StreamResponse:
        return await self._generate(request, call, _CHAT)

    async def _generate(
        self, request: web.Request, call: HttpCall, endpoint: _Endpoint
    ) -> web.StreamResponse:
        body = await self._parse(request, endpoint.body)
        response_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        last_event = request.headers.get("Last-Event-ID") if body.stream else None
        resumed: list[str] = []
        if last_event:  # the SSE reconnection of a stream that broke
            response_id, resumed = _parse_event_id(last_event, endpoint.id_prefix)
        generate = endpoint.to_requests(body, response_id)
        if len(resumed) not in (0, len(generate)):
            raise InvalidRequestError(
                "Last-Event-ID", f"names {len(resumed)} choices; this request has "
                f"{len(generate)}: send the request the stream began with")  # fmt: skip
        for outgoing, token in zip(generate, resumed, strict=False):
            if token:
                outgoing.resume.resume_token = token
        call.records_before_sending = bool(body.stream)
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            echo = await self._echo(generate, body.n)
        model = self.servicer.model
        created = int(time.time())
        choices = [Choice(index=i, copy=i % body.n) for i in range(len(generate))]
        for choice, outgoing, token in zip(choices, generate, resumed, strict=False):
            if token:  # it has sent its first chunk (role, echoed prompt) already
                # The text sent before the break: text_offset goes on from it, and a forced
                # tool call is built from all of it.
                sent = await self.servicer.resumed_text(outgoing, call)
                choice.text.append(sent)
                choice.num_chars = len(sent)
        # A forced tool call: how the output text becomes the message's tool_calls.
        tool_mode = structured.constraint(body)[1] if endpoint is _CHAT else None
        fanout = _Fanout(self.servicer, generate, body.n, call)
        try:
            messages = fanout.messages()
            if isinstance(body, CompletionRequest) and echo_only(body):
                messages = _prompt_only(messages)
            # The first message before any byte of the response: a request refused
            # (admission, context length, model) gets its HTTP status.
            first = await anext(messages, None)
            if body.stream:
                return await self._stream(request, body, endpoint, response_id, created,
                                          choices, echo, first, messages, tool_mode,
                                          resumed)  # fmt: skip
            if first is not None:
                choices[first[0]].add(first[1])
            async for index, message in messages:
                choices[index].add(message)
        finally:
            await fanout.close()
        usage = responses.usage_body(choices)
        if endpoint is _CHAT:
            want = bool(body.logprobs)
            rendered = [responses.chat_choice(c, self.token_text, want, tool_mode) for c in choices]
            return web.json_response(responses.response_body(
                "chat.completion", response_id, created, model, rendered, usage))  # fmt: skip
        want = body.logprobs is not None
        rendered = [
            responses.completion_choice(c, self.token_text, want, echo[c.index] if echo else None)
            for c in choices
        ]
        body = responses.response_body("text_completion", response_id, created, model, rendered,
                                       usage)  # fmt: skip
        return web.json_response(body)

    async def _echo(
        self, requests: list[gateway_pb2.GenerateRequest], n: int
    ) -> list[tuple[str, list[int]]]:
        """Each choice's prompt as text and token ids (a prompt given as ids is decoded)."""
        out = []
        for first in range(0, len(requests), n):
            request = requests[first]
            ids = await self.servicer.prompt_ids(request)
            text = (
                request.raw_prompt
                if request.WhichOneof("input") == "raw_prompt"
                else self.servicer.tokenizer.decode(ids)
            )
            out += [(text, ids)] * n
        return out

    async def _stream(
        self, request: web.Request, body: Any, endpoint: _Endpoint, response_id: str,
        created: int, choices: list[Choice], echo: list[tuple[str, list[int]]] | None,
        first: tuple[int, gateway_pb2.GenerateResponse] | None,
        messages: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
        tool_mode: ToolMode | None, resumed: list[str],
    ) -> web.StreamResponse:  # fmt: skip
        """Server-sent events: a chunk per message, then (``stream_options.include_usage``)
        one with the usage and no choices, then ``[DONE]``. A failure after the first byte
        goes out as an event holding OpenAI's error JSON. Each chunk's ``id:`` field is
        what resumes the stream after it (the SSE reconnection: the same request again with
        ``Last-Event-ID``), on any gateway of the cluster."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunk = _ChunkWriter(self, endpoint, body, response_id, created, echo, include_usage,
                             tool_mode)  # fmt: skip
        tokens = list(resumed) or [""] * len(choices)  # each choice's latest resume token

        def event(index: int, message: gateway_pb2.GenerateResponse) -> bytes:
            tokens[index] = message.resume_token or tokens[index]
            return _event_id(response_id, tokens) + chunk.event(choices[index], message)

        try:
            if first is not None:
                await response.write(event(*first))
            async for index, message in messages:
                await response.write(event(index, message))
            if include_usage:
                usage = chunk.usage(responses.usage_body(choices))
                await response.write(_event_id(response_id, tokens) + usage)
        except PdserveError as exc:
            _, error = from_exception(exc)
            await response.write(_sse(error))
        await response.write(_DONE)
        await response.write_eof()
        return response


class _BadJson(PdserveError):
    reason = "INVALID_ARGUMENT"

    def __init__(self, detail: str) -> None:
        super().__init__(f"the request body is not valid JSON: {detail}")


def _event_id(response_id: str, tokens: list[str]) -> bytes:
    """An SSE ``id:`` line: the response's id, then each choice's latest resume token
    (empty for a choice that has sent nothing); none where the gateway keeps no records."""
    if not any(tokens):
        return b""
    return f"id: {response_id};{','.join(tokens)}\n".encode()


def _parse_event_id(value: str, id_prefix: str) -> tuple[str, list[str]]:
    """``Last-Event-ID`` back into the response id and the choices' resume tokens."""
    response_id, _, tokens = value.strip().partition(";")
    prefix = f"{id_prefix}-"
    if not response_id.startswith(prefix) or not tokens or len(value) > 64 * 1024:
        raise InvalidRequestError(
            "Last-Event-ID", f"{value[:80]!r} is not an event id this endpoint sent")
    return response_id, tokens.split(",")


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _prompt_only(
    messages: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
    """An echo with ``max_tokens: 0``: the token computed with the prompt is dropped (its
    text, id and logprob; usage counts no completion token), the prompt's logprobs kept. It
    ends at its length (0), whatever the dropped token was."""
    async for index, message in messages:
        message.ClearField("token_ids")
        message.ClearField("logprobs")
        message.text = ""
        if message.HasField("usage"):
            message.usage.completion_tokens = 0
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            message.finish_reason = common_pb2.FINISH_REASON_LENGTH
        yield index, message


class _ChunkWriter:
    """One stream's chunks: each choice's first chunk carries the role (chat) or the echoed
    prompt (completions); every chunk has ``usage: null`` when usage comes at the end."""

    def __init__(
        self, server: OpenAIServer, endpoint: _Endpoint, body: Any, response_id: str,
        created: int, echo: list[tuple[str, list[int]]] | None, include_usage: bool,
        tool_mode: ToolMode | None = None,
    ) -> None:  # fmt: skip
        self.token_text = server.token_text
        self.chat = endpoint is _CHAT
        self.body = body
        self.echo = echo
        self.head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": server.servicer.model,
        }
        self.include_usage = include_usage
        self.tool_mode = tool_mode

    def event(self, choice: Choice, message: gateway_pb2.GenerateResponse) -> bytes:
        first = not choice.text
        offset = choice.num_chars  # text_offset goes on from the previous chunks
        if self.echo is not None:
            offset += len(self.echo[choice.index][0])
        choice.add(message)  # for the usage at the end
        finish = finish_reason_name(message.finish_reason) if message.finish_reason else None
        if self.chat:
            delta: dict[str, Any] = {"content": message.text}
            if self.tool_mode is not None:  # the call goes out whole, with the last chunk
                delta = {"content": ""} if finish is None else self._tool_delta(choice)
                if "tool_calls" in delta and finish == "stop":
                    finish = "tool_calls"
            if first:
                delta = {"role": "assistant", **delta}
            logprobs = (
                responses.chat_logprobs(message.logprobs, self.token_text)
                if self.body.logprobs
                else None
            )
            item: dict[str, Any] = {
                "index": choice.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish,
            }  # fmt: skip
        else:
            text = message.text
            logprobs = None
            want = self.body.logprobs is not None
            if first and self.echo is not None:
                prompt_text, prompt_ids = self.echo[choice.index]
                text = prompt_text + text
                if want:
                    head = responses.completion_logprobs(
                        message.prompt_logprobs, self.token_text, 0,
                        prompt_ids[0] if prompt_ids else None,
                    )  # fmt: skip
                    tail = responses.completion_logprobs(
                        message.logprobs, self.token_text, len(prompt_text)
                    )
                    logprobs = {key: head[key] + tail[key] for key in head}
            elif want:
                logprobs = responses.completion_logprobs(
                    message.logprobs, self.token_text, offset
                )
            item = {
                "index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": finish,
            }  # fmt: skip
        payload: dict[str, Any] = {**self.head, "choices": [item]}
        if self.include_usage:
            payload["usage"] = None
        return _sse(payload)

    def _tool_delta(self, choice: Choice) -> dict[str, Any]:
        assert self.tool_mode is not None
        text = "".join(choice.text)
        calls = self.tool_mode.tool_calls(text)
        if calls is None:
            return {"content": text}  # incomplete: what there is, as text
        return {"content": None, "tool_calls": [{"index": 0, **calls[0]}]}

    def usage(self, usage: dict[str, Any]) -> bytes:
        return _sse({**self.head, "choices": [], "usage": usage})

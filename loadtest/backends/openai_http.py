"""Any OpenAI-compatible server that streams (Server-Sent Events): ``/v1/completions`` or
``/v1/chat/completions`` with ``stream: true``.

Completions send the prompt as token ids (vLLM, SGLang and llama.cpp's server accept a
list of ids), so prompt lengths are exact; chat sends the prompt's decoded text as one
user message, so the server's token count may differ a little. Output tokens come from
the final ``usage`` (``stream_options.include_usage``), else one per content chunk. Time
to first token and inter-token gaps count every chunk that brings a token, with or without
text (as the gRPC backend counts every message with token ids).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from loadtest.backends.base import Backend, RequestOutput, SendOptions
from loadtest.datasets.base import SampleRequest

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


class OpenAIHttpBackend(Backend):
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        chat: bool = False,
        endpoint: str | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 6 * 3600,
    ) -> None:
        if chat and detokenize is None:
            raise ValueError("the chat backend needs a tokenizer to turn prompts into text")
        self.name = "openai-chat" if chat else "openai"
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + (endpoint or ENDPOINTS[self.name])
        self.model = model
        self.chat = chat
        self.detokenize = detokenize
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self.session.get(self.base_url + "/v1/models") as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} not answering after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)

    def payload(self, request: SampleRequest, options: SendOptions) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.expected_output_len,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": options.ignore_eos,
        }
        if options.cache_salt:
            body["cache_salt"] = options.cache_salt
        if self.chat:
            assert self.detokenize is not None
            text = self.detokenize(request.prompt_token_ids)
            body["messages"] = [{"role": "user", "content": text}]
            body["max_completion_tokens"] = request.expected_output_len
        else:
            body["prompt"] = list(request.prompt_token_ids)
        return body

    def _content(self, choice: dict[str, Any]) -> str:
        if self.chat:
            delta = choice.get("delta") or {}
            return str(delta.get("content") or delta.get("reasoning_content") or "")
        return str(choice.get("text") or "")

    async def send(
        self, request: SampleRequest, request_id: str, options: SendOptions
    ) -> RequestOutput:
        out = RequestOutput(request_id, request.prompt_len, request.category)
        headers = {**self.headers, "x-request-id": request_id}
        usage: dict[str, Any] = {}
        out.start_time = time.perf_counter()
        try:
            async with self.session.post(
                self.url, json=self.payload(request, options), headers=headers
            ) as resp:
                if resp.status != 200:
                    out.status_code = f"HTTP {resp.status}"
                    out.error = (await resp.text())[:500]
                    out.end_time = time.perf_counter()
                    return out
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    now = time.perf_counter()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        raise RuntimeError(f"server error in stream: {event['error']}")
                    for choice in event.get("choices") or []:
                        # A chunk is a token's arrival: with text, or without text and not
                        # the last (a token whose text waits for the next, as pdserve sends
                        # and llama-server does for a split UTF-8 character). A last chunk
                        # without text (the stop token) and a chat's opening chunk with
                        # the role alone (vLLM, llama-server) bring no token.
                        text = self._content(choice)
                        role_only = "role" in (choice.get("delta") or {})
                        if text or not (choice.get("finish_reason") or role_only):
                            out.add_chunk(now, 0, text)
                    if event.get("usage"):
                        usage = event["usage"]
                    out.end_time = now
            out.success = True
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
            out.end_time = time.perf_counter()
            out.status_code = type(exc).__name__
            out.error = str(exc)[:500]
            return out
        out.output_tokens = int(usage.get("completion_tokens") or len(out.chunk_times))
        details = usage.get("prompt_tokens_details") or {}
        out.cached_tokens = int(details.get("cached_tokens") or 0)
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

"""Server-sent-event streams that survive their gateway, for the OpenAI SDK (and any client
built on httpx).

    from openai import AsyncOpenAI
    from pdserve.sse_resume import AsyncResumingTransport

    gateways = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    client = AsyncOpenAI(base_url=gateways[0] + "/v1", api_key="-",
                         http_client=httpx.AsyncClient(transport=AsyncResumingTransport(gateways)))

The transport passes each request through. When a response is an event stream, it hands
the client only whole events (up to a blank line), remembers the last ``id:``, and when the
stream breaks before ``data: [DONE]`` (the gateway died, the connection dropped) it sends
the same request to the next gateway with ``Last-Event-ID`` after a jittered backoff. The
gateway continues every choice after what was sent (no role or echo again), so the client
reads one unbroken stream. Non-streamed requests are not retried here (the SDK has its own
retries for those).

The OpenAI SDK 3.x is built on ``httpx2`` and 1.x on ``httpx``: whichever is installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from pdserve.client import Backoff

try:
    import httpx2 as httpx
except ImportError:  # the OpenAI SDK before 3.x
    import httpx  # type: ignore[no-redef]

DONE = b"data: [DONE]"
DEFAULT_BACKOFF = Backoff()


class EventSplitter:
    """Bytes in, whole events out: everything up to the last blank line (``\\n\\n`` or
    ``\\r\\n\\r\\n``), the rest kept for later; ``last_id`` is the last ``id:`` seen in what
    went out, ``done`` whether ``data: [DONE]`` did."""

    def __init__(self) -> None:
        self.pending = b""
        self.last_id: str | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk
        normalized = self.pending.replace(b"\r\n", b"\n")
        end = normalized.rfind(b"\n\n")
        if end < 0:
            return b""
        complete, self.pending = normalized[: end + 2], normalized[end + 2 :]
        for line in complete.split(b"\n"):
            if line.startswith(b"id:"):
                self.last_id = line[3:].strip().decode()
            elif line.strip() == DONE:
                self.done = True
        return complete

    def broken(self) -> bool:
        """The stream ended (or failed) before its end: resume it, if it can be."""
        return not self.done


class _Resumer:
    """What both transports share: the gateways, where a request goes next, the backoff."""

    def __init__(self, gateways: Sequence[str], backoff: Backoff) -> None:
        self.gateways = [httpx.URL(g) for g in gateways]
        if not self.gateways:
            raise ValueError("no gateway URL")
        self.backoff = backoff
        self.num_resumes = 0  # streams resumed after a break, over this transport's life

    def first(self, request: Any) -> int:
        """The gateway the request names, if it is one of ours; else the first."""
        url = request.url
        for i, gateway in enumerate(self.gateways):
            if (gateway.scheme, gateway.host, gateway.port) == (url.scheme, url.host, url.port):
                return i
        return 0

    def again(self, request: Any, index: int, last_id: str) -> Any:
        """The request again, to gateway ``index``, resuming after event ``last_id``."""
        gateway = self.gateways[index]
        url = request.url.copy_with(scheme=gateway.scheme, host=gateway.host, port=gateway.port)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"host",
                                                                               b"last-event-id")]  # fmt: skip
        headers.append((b"Last-Event-ID", last_id.encode()))
        return httpx.Request(request.method, url, headers=headers, content=request.content,
                             extensions=request.extensions)  # fmt: skip

    @staticmethod
    def is_events(response: Any) -> bool:
        kind: str = response.headers.get("content-type", "")
        return response.status_code == 200 and kind.startswith("text/event-stream")

    @staticmethod
    def refused(response: Any, body: bytes) -> Exception:
        """A resume the gateway answered with an error: the stream cannot go on."""
        return httpx.RemoteProtocolError(
            f"the stream broke and its resume was refused: HTTP {response.status_code}: "
            f"{body.decode(errors='replace')[:500]}"
        )


class AsyncResumingTransport(httpx.AsyncBaseTransport):
    """``gateways``: base URLs of one fleet's gateways (``http://host:port``)."""

    def __init__(
        self, gateways: Sequence[str], backoff: Backoff = DEFAULT_BACKOFF,
        inner: Any = None,
    ) -> None:  # fmt: skip
        self.resumer = _Resumer(gateways, backoff)
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()

    @property
    def num_resumes(self) -> int:
        return self.resumer.num_resumes

    async def handle_async_request(self, request: Any) -> Any:
        await request.aread()
        response = await self.inner.handle_async_request(request)
        if not self.resumer.is_events(response):
            return response
        stream = _AsyncEvents(self, request, self.resumer.first(request), response)
        return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                              request=request, extensions=response.extensions)  # fmt: skip

    async def aclose(self) -> None:
        await self.inner.aclose()


class _AsyncEvents(httpx.AsyncByteStream):
    def __init__(self, transport: AsyncResumingTransport, request: Any, index: int,
                 response: Any) -> None:  # fmt: skip
        self.transport, self.request, self.index, self.response = transport, request, index, response
        self.events = EventSplitter()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        resumer = self.transport.resumer
        attempt = 0
        while True:
            try:
                async for chunk in self.response.stream:
                    out = self.events.feed(chunk)
                    if out:
                        attempt = 0
                        yield out
                if not self.events.broken():
                    return
            except httpx.TransportError:
                if self.events.last_id is None or attempt >= resumer.backoff.attempts:
                    raise
            finally:
                await self.response.aclose()
            if self.events.last_id is None or attempt >= resumer.backoff.attempts:
                raise httpx.RemoteProtocolError("the event stream ended before data: [DONE]")
            await asyncio.sleep(resumer.backoff.delay_s(attempt))
            attempt += 1
            self.index = (self.index + 1) % len(resumer.gateways)
            request = resumer.again(self.request, self.index, self.events.last_id)
            self.events.pending = b""  # a torn event is sent again after the resume
            try:
                self.response = await self.transport.inner.handle_async_request(request)
            except httpx.TransportError:
                self.response = _Failed()
                continue
            if not resumer.is_events(self.response):
                body = await self.response.aread()
                raise resumer.refused(self.response, body)
            resumer.num_resumes += 1

    async def aclose(self) -> None:
        await self.response.aclose()


class ResumingTransport(httpx.BaseTransport):
    """The synchronous client's: ``OpenAI(http_client=httpx.Client(transport=...))``."""

    def __init__(
        self, gateways: Sequence[str], backoff: Backoff = DEFAULT_BACKOFF, inner: Any = None
    ) -> None:
        self.resumer = _Resumer(gateways, backoff)
        self.inner = inner if inner is not None else httpx.HTTPTransport()

    @property
    def num_resumes(self) -> int:
        return self.resumer.num_resumes

    def handle_request(self, request: Any) -> Any:
        request.read()
        response = self.inner.handle_request(request)
        if not self.resumer.is_events(response):
            return response
        stream = _Events(self, request, self.resumer.first(request), response)
        return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                              request=request, extensions=response.extensions)  # fmt: skip

    def close(self) -> None:
        self.inner.close()


class _Events(httpx.SyncByteStream):
    def __init__(self, transport: ResumingTransport, request: Any, index: int,
                 response: Any) -> None:  # fmt: skip
        self.transport, self.request, self.index, self.response = transport, request, index, response
        self.events = EventSplitter()

    def __iter__(self) -> Iterator[bytes]:
        resumer = self.transport.resumer
        attempt = 0
        while True:
            try:
                for chunk in self.response.stream:
                    out = self.events.feed(chunk)
                    if out:
                        attempt = 0
                        yield out
                if not self.events.broken():
                    return
            except httpx.TransportError:
                if self.events.last_id is None or attempt >= resumer.backoff.attempts:
                    raise
            finally:
                self.response.close()
            if self.events.last_id is None or attempt >= resumer.backoff.attempts:
                raise httpx.RemoteProtocolError("the event stream ended before data: [DONE]")
            time.sleep(resumer.backoff.delay_s(attempt))
            attempt += 1
            self.index = (self.index + 1) % len(resumer.gateways)
            request = resumer.again(self.request, self.index, self.events.last_id)
            self.events.pending = b""
            try:
                self.response = self.transport.inner.handle_request(request)
            except httpx.TransportError:
                self.response = _Failed()
                continue
            if not resumer.is_events(self.response):
                body = self.response.read()
                raise resumer.refused(self.response, body)
            resumer.num_resumes += 1

    def close(self) -> None:
        self.response.close()


class _Failed:
    """A resume whose connection failed: a stream that breaks at once (the next gateway)."""

    @property
    def stream(self) -> Any:
        return self

    def __iter__(self) -> Iterator[bytes]:
        raise httpx.ConnectError("the gateway did not answer")

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        raise httpx.ConnectError("the gateway did not answer")

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

"""pdserve.sse_resume: whole events out of torn chunks, and a broken event stream resumed
on the next gateway with Last-Event-ID (httpx's MockTransport as the gateways)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx2 as httpx
import pytest

from pdserve.client import Backoff
from pdserve.sse_resume import AsyncResumingTransport, EventSplitter, ResumingTransport

FAST = Backoff(first_s=0.001, max_s=0.001, attempts=3)


def test_only_whole_events_go_out_and_the_last_id_is_theirs() -> None:
    events = EventSplitter()
    assert events.feed(b"id: a;1\ndata: {\"x\"") == b""
    assert events.last_id is None
    out = events.feed(b": 1}\n\nid: a;2\ndata: {")
    assert out == b"id: a;1\ndata: {\"x\": 1}\n\n" and events.last_id == "a;1"
    assert events.broken()
    out = events.feed(b"}\r\n\r\ndata: [DONE]\n\n")
    assert out == b"id: a;2\ndata: {}\n\ndata: [DONE]\n\n" and events.last_id == "a;2"
    assert not events.broken()


class Torn(httpx.SyncByteStream, httpx.AsyncByteStream):
    """Some chunks, then the connection drops."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        raise httpx.RemoteProtocolError("peer closed connection")

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        raise httpx.RemoteProtocolError("peer closed connection")


def gateways(seen: list[httpx.Request], second: httpx.Response | None = None) -> httpx.MockTransport:
    """Gateway a sends one whole event and half of the next, then dies; gateway b
    continues after the Last-Event-ID it is given."""

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        events = {"content-type": "text/event-stream"}
        if request.url.host == "a":
            return httpx.Response(200, headers=events, stream=Torn(
                [b"id: r;1\ndata: one\n\n", b"id: r;1,2\ndata: tw"]))  # fmt: skip
        if second is not None:
            return second
        assert request.headers["last-event-id"] == "r;1"
        return httpx.Response(200, headers=events,
                              content=b"id: r;1,2\ndata: two\n\ndata: [DONE]\n\n")  # fmt: skip

    return httpx.MockTransport(answer)


def test_a_broken_stream_goes_on_at_the_next_gateway() -> None:
    seen: list[httpx.Request] = []
    transport = ResumingTransport(["http://a:1", "http://b:2"], FAST, inner=gateways(seen))
    with (
        httpx.Client(transport=transport) as client,
        client.stream("POST", "http://a:1/v1/completions", json={"stream": True}) as reply,
    ):
        body = b"".join(reply.iter_bytes())
    assert body == b"id: r;1\ndata: one\n\nid: r;1,2\ndata: two\n\ndata: [DONE]\n\n"
    assert transport.num_resumes == 1
    assert [r.url.host for r in seen] == ["a", "b"]
    assert seen[1].content == seen[0].content == b'{"stream":true}'


def test_the_async_transport_resumes_alike() -> None:
    seen: list[httpx.Request] = []
    transport = AsyncResumingTransport(["http://a:1", "http://b:2"], FAST, inner=gateways(seen))

    async def run() -> bytes:
        async with (
            httpx.AsyncClient(transport=transport) as client,
            client.stream("POST", "http://a:1/v1/chat/completions", json={"stream": True}) as reply,
        ):
            return b"".join([chunk async for chunk in reply.aiter_bytes()])

    body = asyncio.run(run())
    assert body.endswith(b"data: two\n\ndata: [DONE]\n\n") and transport.num_resumes == 1


def test_a_refused_resume_ends_the_stream_with_the_gateways_answer() -> None:
    expired = httpx.Response(404, json={"error": {"message": "no such request: r"}})
    transport = ResumingTransport(["http://a:1", "http://b:2"], FAST,
                                  inner=gateways([], second=expired))  # fmt: skip
    with (
        httpx.Client(transport=transport) as client,
        client.stream("POST", "http://a:1/v1/completions", json={}) as reply,
        pytest.raises(httpx.RemoteProtocolError, match=r"HTTP 404.*no such request"),
    ):
        b"".join(reply.iter_bytes())

"""Resumable streams: what lets a client continue a request whose stream broke (its gateway
died, the network dropped) on any gateway of the cluster (``GenerateRequest.resume``).

Each streamed request has a record in Redis, kept by the gateway that serves it:

- at the start, the request as the workers see it (a ``DecodeRequest``: the client's request
  id, the prompt's token ids, the sampling, the tenant's cache salt);
- as it streams, the tokens it has sent, appended behind the stream: a message never waits
  for Redis; one request's writes go out in order, one at a time, each carrying every token
  sent since the last;
- at the end, its last message.

Every write renews the record's TTL (``--resume-ttl-s``), so a request can be resumed that
long after its last message; Redis holds no more than the requests of that window (each
record is its prompt's and output's token ids, 4 bytes each, and its sampling). A gateway
holds only the writes not yet done, and drops a record it cannot write (Redis down) rather
than queue it.

The resume token on each message is ``<resume id>.<tokens sent>``: the id is 128 random bits
of the gateway's, so a token cannot be guessed, and a resume by another tenant (API key) or
with another cache salt finds nothing, which it is told exactly as for an unknown or expired
token (NOT_FOUND): a tenant learns nothing of another's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.errors import InvalidRequestError, NotFoundError
from common.index import keys
from common.telemetry.metrics import metric_name
from pdserve.decode.v1 import decode_pb2
from pdserve.gateway.v1 import gateway_pb2

log = logging.getLogger(__name__)

RESUME_ID_HEX = 32  # 128 bits
# What a resume is answered with when it names no record this caller may see.
NO_RECORD = (
    "no resumable request for this resume_token: it is unknown, its record expired "
    "(--resume-ttl-s after its last message), or it belongs to another caller"
)
# Outcomes of pdserve:resumes_total{outcome}.
OUTCOMES = ("continued", "finished", "not_found", "mismatch")


def make_token(resume_id: str, position: int) -> str:
    return f"{resume_id}.{position}"


def parse_token(token: str) -> tuple[str, int]:
    """(resume id, tokens sent); INVALID_ARGUMENT for a token no gateway made."""
    resume_id, _, position = token.partition(".")
    if (
        len(resume_id) != RESUME_ID_HEX
        or not all(c in "0123456789abcdef" for c in resume_id)
        or not position.isdigit()
    ):
        raise InvalidRequestError(
            "resume.resume_token", f"{token[:80]!r} is not a resume token a gateway sent"
        )
    return resume_id, int(position)


def _pack(token_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _unpack(raw: bytes) -> list[int]:
    usable = len(raw) - len(raw) % 4
    return list(struct.unpack(f"<{usable // 4}I", raw[:usable]))


@dataclass
class ResumeRecord:
    request: decode_pb2.DecodeRequest  # request id, prompt ids, sampling, cache salt
    tokens: list[int]  # the tokens sent so far (as far as the writes got)
    final: gateway_pb2.GenerateResponse | None  # its last message, once finished


class ResumeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.resumes = Counter(
            metric_name("resumes"),
            "Resumes of broken streams by outcome: continued, finished (a finished request's "
            "end returned), not_found (unknown, expired or another caller's), mismatch (the "
            "client's tokens differ from the request's).",
            ["outcome"], registry=registry,
        )  # fmt: skip
        for outcome in OUTCOMES:
            self.resumes.labels(outcome)
        self.records_writing = Gauge(
            metric_name("resume_records_writing"),
            "Requests whose resume record this gateway is writing (each holds at most the "
            "tokens sent since its last write).",
            registry=registry,
        )
        self.recomputed_tokens = Counter(
            metric_name("resume_recomputed_tokens"),
            "Context tokens (the prompt and the tokens sent before the break) that a resumed "
            "request's decode worker computed again: neither in its prefix cache nor in the "
            "block store.",
            registry=registry,
        )
        self.write_failures = Counter(
            metric_name("resume_write_failures"),
            "Resume-record writes that Redis refused or did not answer (the request streams "
            "on; a resume of it may then find less, or nothing).",
            registry=registry,
        )


@dataclass
class _Writer:
    """One request's writes not yet done."""

    request: bytes | None  # the record's request, until written
    pending: list[int] = field(default_factory=list)
    final: bytes | None = None
    task: asyncio.Task[None] | None = None
    done: bool = False  # the final message is written (or dropped)


class ResumeStore:
    def __init__(
        self, redis: Any, model: str, ttl_s: float, metrics: ResumeMetrics | None = None
    ) -> None:
        self.redis = redis
        self.model = model
        self.ttl_ms = int(ttl_s * 1000)
        self.metrics = metrics
        self._writers: dict[str, _Writer] = {}
        if metrics is not None:
            metrics.records_writing.set_function(lambda: len(self._writers))

    @property
    def enabled(self) -> bool:
        return self.ttl_ms > 0

    def begin(self, request: decode_pb2.DecodeRequest) -> str:
        """A new record for ``request`` (written behind); its resume id."""
        resume_id = secrets.token_hex(RESUME_ID_HEX // 2)
        stored = decode_pb2.DecodeRequest()
        stored.CopyFrom(request)
        stored.ClearField("kv_source")  # a resume continues with local prefill
        stored.ClearField("generated_token_ids")
        self._writers[resume_id] = _Writer(request=stored.SerializeToString())
        self._kick(resume_id)
        return resume_id

    def adopt(self, resume_id: str, unrecorded: list[int]) -> None:
        """Go on writing a record another gateway began (a resumed request), first the
        tokens the client had that the record lacked."""
        self._writers[resume_id] = _Writer(request=None, pending=list(unrecorded))
        if unrecorded:
            self._kick(resume_id)

    def sent(self, resume_id: str, token_ids: list[int]) -> None:
        writer = self._writers.get(resume_id)
        if writer is not None and token_ids:
            writer.pending += token_ids
            self._kick(resume_id)

    def finished(self, resume_id: str, message: gateway_pb2.GenerateResponse) -> None:
        writer = self._writers.get(resume_id)
        if writer is None:
            return
        final = gateway_pb2.GenerateResponse()
        final.CopyFrom(message)
        # The end a resume returns: why it stopped, usage, timings (its tokens and text are
        # rebuilt from the token list).
        for name in ("text", "token_ids", "logprobs", "prompt_logprobs", "resume_token"):
            final.ClearField(name)
        writer.final = final.SerializeToString()
        self._kick(resume_id)

    def _kick(self, resume_id: str) -> None:
        writer = self._writers[resume_id]
        if writer.task is None or writer.task.done():
            writer.task = asyncio.get_running_loop().create_task(self._write(resume_id, writer))

    async def _write(self, resume_id: str, writer: _Writer) -> None:
        record = keys.resume(self.model, resume_id)
        tokens = keys.resume_tokens(self.model, resume_id)
        while writer.request is not None or writer.pending or writer.final is not None:
            pipe = self.redis.pipeline(transaction=False)
            request, pending, final = writer.request, writer.pending, writer.final
            writer.request, writer.pending, writer.final = None, [], None
            if request is not None:
                pipe.hset(record, "request", request)
            if pending:
                pipe.append(tokens, _pack(pending))
            if final is not None:
                pipe.hset(record, "final", final)
            pipe.pexpire(record, self.ttl_ms)
            pipe.pexpire(tokens, self.ttl_ms)
            try:
                await pipe.execute()
            except Exception as exc:  # advisory: the stream goes on without it
                log.debug("resume record %s: write failed: %s", resume_id, exc)
                if self.metrics is not None:
                    self.metrics.write_failures.inc()
            if final is not None:
                writer.done = True
        if writer.done:
            self._writers.pop(resume_id, None)

    async def flushed(self, resume_id: str, timeout_s: float) -> bool:
        """Waits (at most ``timeout_s``) until what the request has sent is written: for a
        front door whose client resumes by position alone (server-sent events), so that a
        resume never names tokens the record lacks. False if the wait ran out."""
        writer = self._writers.get(resume_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while writer is not None and writer.task is not None and not writer.task.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await asyncio.wait({writer.task}, timeout=remaining)
        return True

    def forget(self, resume_id: str) -> None:
        """The request ended without a final message (an error, a cancellation): its writes
        finish, and the record stays for a resume until its TTL."""
        writer = self._writers.get(resume_id)
        if writer is not None:
            writer.done = True
            if writer.task is None or writer.task.done():
                self._writers.pop(resume_id, None)

    async def load(self, resume_id: str) -> ResumeRecord | None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(keys.resume(self.model, resume_id))
        pipe.get(keys.resume_tokens(self.model, resume_id))
        fields, raw_tokens = await pipe.execute()
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        if "request" not in fields:
            return None
        request = decode_pb2.DecodeRequest.FromString(fields["request"])
        final = None
        if "final" in fields:
            final = gateway_pb2.GenerateResponse.FromString(fields["final"])
        return ResumeRecord(request, _unpack(raw_tokens or b""), final)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Lets the writes in progress finish (a drain), at most ``timeout_s``."""
        tasks = [w.task for w in self._writers.values() if w.task is not None]
        if tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait(tasks, timeout=timeout_s)


def check_resume(
    record: ResumeRecord | None, salt: str, received: list[int], position: int = 0
) -> tuple[ResumeRecord, list[int]]:
    """The record a resume may continue, and the tokens it continues after: the client's,
    or (a client that sent none: server-sent events) the record's first ``position``.
    NOT_FOUND when there is no record for this caller (the salt binds the tenant and the
    cache salt); INVALID_ARGUMENT naming the first position where the client's tokens
    differ from those the request sent."""
    if record is None or record.request.cache_salt != salt:
        raise NotFoundError(NO_RECORD)
    if not received and position:
        if position > len(record.tokens):
            raise InvalidRequestError(
                "resume.resume_token",
                f"it names {position} tokens sent; the record holds {len(record.tokens)}: "
                "send the token ids received (resume.token_ids)",
            )
        received = record.tokens[:position]
    for position, (theirs, ours) in enumerate(zip(received, record.tokens, strict=False)):
        if theirs != ours:
            raise InvalidRequestError(
                "resume.token_ids",
                f"position {position} holds token {theirs}; the request sent {ours} there",
            )
    if record.final is not None and len(received) > len(record.tokens):
        raise InvalidRequestError(
            "resume.token_ids",
            f"{len(received)} tokens given; the request ended after {len(record.tokens)}",
        )
    return record, received

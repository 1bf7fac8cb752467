"""Admission control: the gateway's bound on the work it takes in, before any tokenization.

Two quantities are bounded, for the whole gateway and for each tenant:

- requests in flight: admitted and not yet finished;
- queued prompt tokens: prompt tokens of admitted requests whose first token has not come
  back yet (prefill work waiting or running). A request is admitted on an estimate made
  from its size alone (``estimate_prompt_tokens``), then ``Ticket.account`` replaces the
  estimate with the real count once tokenized.

A request that would pass a bound gets ``QueueFullError`` (RESOURCE_EXHAUSTED, reason
QUEUE_FULL) at once, with a retry delay and ErrorInfo metadata naming the bound and scope.
An empty queue always admits one request, so a bound smaller than one prompt delays
nothing that could ever run. Single-threaded: call from the event loop only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.errors import QueueFullError

# Characters per token when estimating from text size: BPE tokenizers of English average
# about 4; 3 leans towards over-estimating, which errs on the side of refusing.
CHARS_PER_TOKEN_ESTIMATE = 3
MESSAGE_OVERHEAD_TOKENS = 8  # role and template markup around each chat message
MIN_RETRY_MS = 10
MAX_RETRY_MS = 30_000
DEFAULT_RETRY_MS = 100
EWMA_WEIGHT = 0.2

IN_FLIGHT = "in_flight_requests"
QUEUED_TOKENS = "queued_prompt_tokens"


@dataclass(frozen=True)
class AdmissionLimits:
    max_in_flight: int
    max_queued_prompt_tokens: int
    max_in_flight_per_tenant: int
    max_queued_prompt_tokens_per_tenant: int

    def __post_init__(self) -> None:
        for name in (
            "max_in_flight",
            "max_queued_prompt_tokens",
            "max_in_flight_per_tenant",
            "max_queued_prompt_tokens_per_tenant",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def estimate_prompt_tokens(request: Any) -> int:
    """Prompt tokens of a GenerateRequest guessed from its size, without tokenizing."""
    field_name = request.WhichOneof("input")
    if field_name == "token_ids":
        return len(request.token_ids.ids)
    if field_name == "messages":
        return sum(
            MESSAGE_OVERHEAD_TOKENS + _text_tokens(len(m.content))
            for m in request.messages.messages
        )
    if field_name == "prompt":
        return MESSAGE_OVERHEAD_TOKENS + _text_tokens(len(request.prompt))
    if field_name == "raw_prompt":
        return _text_tokens(len(request.raw_prompt))
    return 0


def _text_tokens(num_chars: int) -> int:
    return math.ceil(num_chars / CHARS_PER_TOKEN_ESTIMATE)


@dataclass
class _Load:
    in_flight: int = 0
    queued_tokens: int = 0


@dataclass
class _Ewma:
    value_s: float | None = None

    def add(self, sample_s: float) -> None:
        if self.value_s is None:
            self.value_s = sample_s
        else:
            self.value_s += EWMA_WEIGHT * (sample_s - self.value_s)


class Ticket:
    """One admitted request's share of the bounds; ``release`` it exactly once (finally)."""

    def __init__(self, admission: Admission, tenant: str, queued_tokens: int) -> None:
        self.admission = admission
        self.tenant = tenant
        self.queued_tokens = queued_tokens
        self.admitted_at = time.monotonic()
        self._released = False

    def account(self, num_prompt_tokens: int) -> None:
        """Replaces the estimate with the tokenized prompt's real size."""
        if self.queued_tokens:
            self.admission._requeue(self, num_prompt_tokens)

    def prefilled(self) -> None:
        """The first token came back: the prompt is no longer queued work."""
        if self.queued_tokens:
            self.admission._requeue(self, 0)
            self.admission.time_to_prefill.add(time.monotonic() - self.admitted_at)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.admission._release(self)


@dataclass
class Admission:
    limits: AdmissionLimits
    on_reject: Callable[[str, str], None] = lambda bound, scope: None
    total: _Load = field(default_factory=_Load)
    tenants: dict[str, _Load] = field(default_factory=dict)  # only tenants with work in
    time_to_prefill: _Ewma = field(default_factory=_Ewma)
    duration: _Ewma = field(default_factory=_Ewma)

    def admit(self, tenant: str, estimated_tokens: int) -> Ticket:
        """A ticket for the request, or QueueFullError if a bound would be passed."""
        limits = self.limits
        mine = self.tenants.get(tenant) or _Load()
        if self.total.in_flight >= limits.max_in_flight:
            self._reject(IN_FLIGHT, "global", self.total.in_flight, limits.max_in_flight)
        if mine.in_flight >= limits.max_in_flight_per_tenant:
            self._reject(IN_FLIGHT, "tenant", mine.in_flight, limits.max_in_flight_per_tenant)
        estimated_tokens = max(0, estimated_tokens)
        if self.total.queued_tokens and (
            self.total.queued_tokens + estimated_tokens > limits.max_queued_prompt_tokens
        ):
            self._reject(
                QUEUED_TOKENS, "global", self.total.queued_tokens, limits.max_queued_prompt_tokens
            )
        if mine.queued_tokens and (
            mine.queued_tokens + estimated_tokens > limits.max_queued_prompt_tokens_per_tenant
        ):
            self._reject(
                QUEUED_TOKENS,
                "tenant",
                mine.queued_tokens,
                limits.max_queued_prompt_tokens_per_tenant,
            )
        load = self.tenants.setdefault(tenant, mine)
        load.in_flight += 1
        load.queued_tokens += estimated_tokens
        self.total.in_flight += 1
        self.total.queued_tokens += estimated_tokens
        return Ticket(self, tenant, estimated_tokens)

    def retry_after_ms(self, bound: str) -> int:
        """When a retry may find room: the next slot frees after about the mean request
        duration over the slots; queued prompt work drains in about the mean wait for a
        first token."""
        if bound == IN_FLIGHT:
            mean = self.duration.value_s
            estimate = None if mean is None else mean / max(1, self.total.in_flight)
        else:
            estimate = self.time_to_prefill.value_s
        if estimate is None:
            return DEFAULT_RETRY_MS
        return int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, estimate * 1000)))

    def _reject(self, bound: str, scope: str, current: int, limit: int) -> None:
        self.on_reject(bound, scope)
        what = "requests in flight" if bound == IN_FLIGHT else "queued prompt tokens"
        whose = "the gateway has" if scope == "global" else "this tenant has"
        retry_ms = self.retry_after_ms(bound)
        raise QueueFullError(
            f"overloaded: {whose} {current} {what} (limit {limit}); retry in {retry_ms} ms",
            retry_after_ms=retry_ms,
            metadata={"bound": bound, "scope": scope, "limit": str(limit)},
        )

    def _requeue(self, ticket: Ticket, num_tokens: int) -> None:
        delta = num_tokens - ticket.queued_tokens
        ticket.queued_tokens = num_tokens
        self.total.queued_tokens += delta
        load = self.tenants.get(ticket.tenant)
        assert load is not None, f"tenant {ticket.tenant!r} holds a ticket but has no load"
        load.queued_tokens += delta

    def _release(self, ticket: Ticket) -> None:
        self._requeue(ticket, 0)
        self.duration.add(time.monotonic() - ticket.admitted_at)
        load = self.tenants[ticket.tenant]
        load.in_flight -= 1
        self.total.in_flight -= 1
        assert load.in_flight >= 0 and self.total.in_flight >= 0, "ticket released twice"
        if load.in_flight == 0:
            assert load.queued_tokens == 0, f"tenant {ticket.tenant!r} leaks queued tokens"
            del self.tenants[ticket.tenant]

"""Admission control: exact counts per bound and scope, RetryInfo delays, no leak."""

from __future__ import annotations

import pytest

from common.errors import QueueFullError
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.admission import (
    DEFAULT_RETRY_MS,
    IN_FLIGHT,
    QUEUED_TOKENS,
    Admission,
    AdmissionLimits,
    estimate_prompt_tokens,
)


def limits(**overrides: int) -> AdmissionLimits:
    values = dict(
        max_in_flight=4,
        max_queued_prompt_tokens=100,
        max_in_flight_per_tenant=2,
        max_queued_prompt_tokens_per_tenant=60,
    )
    values.update(overrides)
    return AdmissionLimits(**values)


def rejected(admission: Admission, tenant: str, tokens: int) -> QueueFullError:
    with pytest.raises(QueueFullError) as raised:
        admission.admit(tenant, tokens)
    return raised.value


def test_in_flight_is_bounded_per_tenant_then_globally() -> None:
    seen: list[tuple[str, str]] = []
    admission = Admission(limits(), lambda bound, scope: seen.append((bound, scope)))
    a1, a2 = admission.admit("a", 1), admission.admit("a", 1)
    error = rejected(admission, "a", 1)
    assert error.metadata == {"bound": IN_FLIGHT, "scope": "tenant", "limit": "2"}
    admission.admit("b", 1)
    admission.admit("b", 1)
    error = rejected(admission, "c", 1)
    assert error.metadata == {"bound": IN_FLIGHT, "scope": "global", "limit": "4"}
    assert error.retry_after_ms == DEFAULT_RETRY_MS  # nothing measured yet
    assert seen == [(IN_FLIGHT, "tenant"), (IN_FLIGHT, "global")]
    a1.release()
    a2.release()
    assert "a" not in admission.tenants  # a tenant without work takes no memory
    admission.admit("c", 1)
    assert admission.total.in_flight == 3


def test_queued_tokens_are_bounded_and_an_empty_queue_admits_anything() -> None:
    admission = Admission(limits(max_in_flight_per_tenant=4))
    huge = admission.admit("a", 10_000)  # alone: admitted, though over every bound
    error = rejected(admission, "b", 1)
    assert error.metadata["bound"] == QUEUED_TOKENS and error.metadata["scope"] == "global"
    huge.prefilled()
    assert admission.total.queued_tokens == 0 and admission.total.in_flight == 1
    first = admission.admit("a", 50)
    error = rejected(admission, "a", 11)  # 50 + 11 > 60 for the tenant
    assert error.metadata == {"bound": QUEUED_TOKENS, "scope": "tenant", "limit": "60"}
    second = admission.admit("b", 50)  # another tenant: 100 in all, the global bound
    assert admission.total.queued_tokens == 100
    first.account(20)  # tokenized: fewer than estimated
    assert admission.total.queued_tokens == 70 and admission.tenants["a"].queued_tokens == 20
    admission.admit("a", 30)
    for ticket in (huge, first, second):
        ticket.release()
        ticket.release()  # idempotent
    assert admission.total.queued_tokens == 30 and admission.total.in_flight == 1


def test_retry_delay_follows_measured_times(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("services.gateway.admission.time.monotonic", lambda: now[0])
    admission = Admission(limits(max_in_flight=1, max_in_flight_per_tenant=1))
    ticket = admission.admit("a", 10)
    now[0] += 0.5
    ticket.prefilled()  # 500 ms to the first token
    now[0] += 1.5
    ticket.release()  # 2 s in all
    holder = admission.admit("a", 10)
    assert rejected(admission, "a", 10).retry_after_ms == 2000  # one slot, held ~2 s
    assert admission.retry_after_ms(QUEUED_TOKENS) == 500
    holder.release()


def test_estimates_come_from_sizes_without_tokenizing() -> None:
    assert estimate_prompt_tokens(gateway_pb2.GenerateRequest(token_ids={"ids": [1] * 7})) == 7
    assert estimate_prompt_tokens(gateway_pb2.GenerateRequest(raw_prompt="x" * 30)) == 10
    assert estimate_prompt_tokens(gateway_pb2.GenerateRequest(prompt="x" * 30)) == 18
    chat = gateway_pb2.GenerateRequest(
        messages={"messages": [{"role": "user", "content": "x" * 3}] * 2}
    )
    assert estimate_prompt_tokens(chat) == 2 * (8 + 1)
    assert estimate_prompt_tokens(gateway_pb2.GenerateRequest()) == 0


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_queued_prompt_tokens"):
        limits(max_queued_prompt_tokens=0)

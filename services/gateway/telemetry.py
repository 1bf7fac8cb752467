"""The gateway's side of a request's telemetry: the GenAI request span and the request's
metrics and log line."""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry.trace import Span

from common.contract.sampling import SamplingParams
from services.gateway.metrics import GatewayMetrics
from services.gateway.relay import Relay
from services.gateway.routing import Route

log = logging.getLogger(__name__)


def describe_request(
    span: Span,
    model: str,
    input_field: str,
    request_id: str,
    sampling: SamplingParams,
    num_prompt_tokens: int,
) -> None:
    """Names the request span as the GenAI conventions do (``chat <model>``) and sets
    what the request asked for."""
    operation = "chat" if input_field in ("prompt", "messages") else "text_completion"
    span.update_name(f"{operation} {model}")
    span.set_attributes(
        {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "pdserve",
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.response.id": request_id,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.request.presence_penalty": sampling.presence_penalty,
            "gen_ai.request.frequency_penalty": sampling.frequency_penalty,
            "gen_ai.usage.input_tokens": num_prompt_tokens,
            "pdserve.request_id": request_id,
        }
    )
    if sampling.seed is not None:
        span.set_attribute("gen_ai.request.seed", sampling.seed)
    if sampling.stop:
        span.set_attribute("gen_ai.request.stop_sequences", list(sampling.stop))
    if sampling.structured_output is not None:
        span.set_attribute("pdserve.structured_output", sampling.structured_output.kind.value)


def route_attributes(route: Route) -> dict[str, str | int]:
    return {
        "pdserve.route.reason": route.reason,
        "pdserve.route.decode_worker_id": route.decode.worker_id,
        "pdserve.route.prefill_worker_id": route.prefill.worker_id if route.prefill else "",
        "pdserve.route.overlap_blocks": route.overlap_blocks,
    }


def record_request(
    span: Span,
    metrics: GatewayMetrics,
    relay: Relay,
    route: Route | None,
    failure: BaseException | None,
) -> None:
    """A request's end: its metrics, the usage on its span and its one log line at INFO."""
    now = time.monotonic()
    reason = relay.finish_reason
    if reason is None and isinstance(failure, (asyncio.CancelledError, GeneratorExit)):
        reason = "abort"  # the client went away
    if reason is not None:
        metrics.requests.finished(reason)
        metrics.request_generation_tokens.observe(len(relay.generated))
        if len(relay.generated) > 1 and relay.times.first_at is not None:
            decode_s = relay.times.last_at - relay.times.first_at
            metrics.request_time_per_output_token.observe(decode_s / (len(relay.generated) - 1))
        metrics.requests.e2e_request_latency.observe(now - relay.arrival)
        metrics.requests.request_queue_time.observe(relay.queue_ms / 1000)
        metrics.prefix_cache_queries.inc(len(relay.prompt))
        metrics.prefix_cache_hits.inc(relay.cached_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": len(relay.prompt),
            "gen_ai.usage.output_tokens": len(relay.generated),
            "gen_ai.usage.cache_read.input_tokens": relay.cached_tokens,
            "pdserve.queue_ms": relay.queue_ms,
            "pdserve.ttft_ms": relay.ttft_ms(now),
            "pdserve.migrations": relay.num_migrations,
        }
    )
    log.info(
        "request %s: %s, route %s (prefill %s, decode %s), prompt %d tokens (%d cached), "
        "completion %d tokens, %d migrations; queue %.1f ms, ttft %.1f ms, total %.1f ms",
        relay.request_id,
        reason or f"failed ({type(failure).__name__}: {failure})",
        route.reason if route else "-",
        route.prefill.worker_id if route and route.prefill else "-",
        route.decode.worker_id if route else "-",
        len(relay.prompt),
        relay.cached_tokens,
        len(relay.generated),
        relay.num_migrations,
        relay.queue_ms,
        relay.ttft_ms(now),
        (now - relay.arrival) * 1000,
    )

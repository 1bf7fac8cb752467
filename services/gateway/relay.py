"""Relay: one request's running state while its tokens stream through the gateway, and
the per-token metrics (time to first token, time per output token, token counts)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from common.telemetry.metrics import RequestMetrics, TokenTimes
from common.text.detokenizer import IncrementalDetokenizer
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2


class Relay:
    """One request's running state while tokens stream through the gateway."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        detok: IncrementalDetokenizer,
        metrics: RequestMetrics,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.detok = detok
        self.metrics = metrics
        self.generated: list[int] = []
        self.cached_tokens = 0
        self.arrival = time.monotonic()
        self.times = TokenTimes(metrics, self.arrival)
        self.queue_ms = 0.0
        self.num_migrations = 0  # decode streams that broke and continued elsewhere
        # Context tokens the finishing decode worker computed (neither in its prefix cache
        # nor imported): a continuation's recomputation, when it started from local prefill.
        self.computed_tokens = 0
        self.finish_reason: str | None = None  # set once the final message is built

    def message(
        self,
        token_ids: list[int],
        logprobs: list[Any],
        prompt_logprobs: Sequence[common_pb2.TokenLogprob] = (),
    ) -> gateway_pb2.GenerateResponse:
        """The next message to the client; ``prompt_logprobs`` travel with the first token.
        Tokens past a stop string (a burst can cross one) are dropped here, from the message,
        the usage and the metrics alike."""
        text = self.detok.add(token_ids)
        if self.detok.num_taken < len(token_ids):
            token_ids = token_ids[: self.detok.num_taken]
            logprobs = logprobs[: self.detok.num_taken]
        self.generated += token_ids
        if token_ids:
            if self.times.first_at is None:
                self.metrics.prompt_tokens.inc(len(self.prompt))
            self.times.tokens(len(token_ids), time.monotonic())
        return gateway_pb2.GenerateResponse(
            request_id=self.request_id,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def finish(
        self, message: gateway_pb2.GenerateResponse, reason: common_pb2.FinishReason
    ) -> gateway_pb2.GenerateResponse:
        now = time.monotonic()
        message.text += self.detok.flush()
        message.finish_reason = reason
        self.finish_reason = finish_reason_name(reason)
        message.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=len(self.prompt),
                completion_tokens=len(self.generated),
                cached_tokens=self.cached_tokens,
            )
        )
        message.timings.CopyFrom(
            gateway_pb2.Timings(
                queue_ms=self.queue_ms,
                ttft_ms=self.ttft_ms(now),
                total_ms=(now - self.arrival) * 1000,
            )
        )
        return message

    def ttft_ms(self, now: float) -> float:
        return self.times.ttft_ms(now)


def finish_reason_name(reason: common_pb2.FinishReason) -> str:
    """``FINISH_REASON_STOP`` -> ``stop``, the label vLLM's metrics use."""
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()

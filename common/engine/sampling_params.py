"""SamplingParams: what a request asks of the sampler, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per token, 0..20

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError(
                "sampling.temperature", f"must be >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("sampling.min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(
                "sampling.repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"sampling.{name}", f"must be in [-2, 2], got {value}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                "sampling.top_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            )
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("sampling.stop", "stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequestError("sampling.seed", "must fit in an unsigned 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_vocab(self, vocab_size: int) -> None:
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    "sampling.stop_token_ids", f"token id {token_id} is outside [0, {vocab_size})"
                )

"""SamplingParams: what a request asks of the sampler, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.contract.eviction import KvCompression, KvEviction
from common.contract.structured import MAX_CONSTRAINT_CHARS, StructuredOutput
from common.errors import InvalidRequestError

if TYPE_CHECKING:  # the engine imports this module and no generated stub at run time
    from pdserve.common.v1.common_pb2 import SamplingParams as SamplingParamsPb

MAX_TOP_LOGPROBS = 20
# Alternatives per prompt position (vLLM's max_logprobs): each costs a top-k over the vocab.
MAX_PROMPT_LOGPROBS = 20
# Bounds that keep one request's per-token stop checks cheap.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


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
    # vLLM's prompt_logprobs: None = off; k = every prompt token after the first gets its
    # own logprob and the k most likely alternatives (raw model distribution, float32
    # log-softmax). Every prompt position is then computed: no prefix-cache hit or imported
    # KV skips any.
    prompt_logprobs: int | None = None
    # False: this request is never speculated on, whatever the decode worker's
    # --speculative-config (the output is the same either way; the cost is not).
    speculative: bool = True
    # vLLM's min_tokens: before this many tokens are generated, end-of-sequence and stop
    # token ids are masked out of the sampler's distribution and stop strings do not stop.
    min_tokens: int = 0
    # Structured output: the output must satisfy this constraint (None = unconstrained).
    structured_output: StructuredOutput | None = None
    # StreamingLLM for this request (None = the worker's default): the stream keeps sinks
    # and a window, and may run past the context.
    kv_eviction: KvEviction | None = None
    # SnapKV prompt compression for this request (None = the worker's default).
    kv_compression: KvCompression | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "sampling.min_tokens",
                f"must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}",
            )
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
        if self.prompt_logprobs is not None and not (
            0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS
        ):
            raise InvalidRequestError(
                "sampling.prompt_logprobs",
                f"must be in [0, {MAX_PROMPT_LOGPROBS}] (or unset), got {self.prompt_logprobs}",
            )
        check_stop_sizes(len(self.stop), max(map(len, self.stop), default=0))
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("sampling.stop", "stop strings must be non-empty")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "sampling.stop_token_ids",
                f"{len(self.stop_token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}",
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequestError("sampling.seed", "must fit in an unsigned 64-bit integer")

    @classmethod
    def check_pb_sizes(cls, pb: SamplingParamsPb) -> None:
        """The size bounds alone, on a ``pdserve.common.v1.SamplingParams``: cheap, for
        refusing before any other work."""
        check_stop_sizes(len(pb.stop), max(map(len, pb.stop), default=0))
        if len(pb.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "sampling.stop_token_ids",
                f"{len(pb.stop_token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS}",
            )
        which = pb.structured_output.WhichOneof("constraint")
        if which is not None and which != "json_object":
            size = len(getattr(pb.structured_output, which))
            if size > MAX_CONSTRAINT_CHARS:
                raise InvalidRequestError(
                    f"sampling.structured_output.{which}",
                    f"{size} characters; at most {MAX_CONSTRAINT_CHARS}",
                )

    @classmethod
    def from_pb(cls, pb: SamplingParamsPb, default_max_tokens: int) -> SamplingParams:
        """From ``pdserve.common.v1.SamplingParams``: unset optionals take the API defaults
        (temperature 1.0, top_p 1.0, repetition_penalty 1.0); max_tokens 0 means
        ``default_max_tokens`` (what is left of the context)."""
        return cls(
            max_tokens=pb.max_tokens or default_max_tokens,
            temperature=pb.temperature if pb.HasField("temperature") else 1.0,
            top_p=pb.top_p if pb.HasField("top_p") else 1.0,
            top_k=pb.top_k,
            min_p=pb.min_p,
            seed=pb.seed if pb.HasField("seed") else None,
            repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
            presence_penalty=pb.presence_penalty,
            frequency_penalty=pb.frequency_penalty,
            stop=tuple(pb.stop),
            stop_token_ids=tuple(pb.stop_token_ids),
            ignore_eos=pb.ignore_eos,
            logprobs=pb.logprobs,
            top_logprobs=pb.top_logprobs,
            prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
            speculative=not pb.disable_speculation,
            min_tokens=pb.min_tokens,
            structured_output=StructuredOutput.from_pb(pb.structured_output)
            if pb.HasField("structured_output")
            else None,
            kv_eviction=KvEviction.from_pb(pb.kv_eviction) if pb.HasField("kv_eviction") else None,
            kv_compression=KvCompression.from_pb(pb.kv_compression)
            if pb.HasField("kv_compression")
            else None,
        )

    def to_pb(self, pb: SamplingParamsPb) -> SamplingParamsPb:
        """Fills a ``pdserve.common.v1.SamplingParams`` (explicit values, no defaults)."""
        pb.max_tokens = self.max_tokens
        pb.temperature = self.temperature
        pb.top_p = self.top_p
        pb.top_k = self.top_k
        pb.min_p = self.min_p
        if self.seed is not None:
            pb.seed = self.seed
        pb.repetition_penalty = self.repetition_penalty
        pb.presence_penalty = self.presence_penalty
        pb.frequency_penalty = self.frequency_penalty
        pb.stop[:] = list(self.stop)
        pb.stop_token_ids[:] = list(self.stop_token_ids)
        pb.ignore_eos = self.ignore_eos
        pb.logprobs = self.logprobs
        pb.top_logprobs = self.top_logprobs
        if self.prompt_logprobs is not None:
            pb.prompt_logprobs = self.prompt_logprobs
        else:
            pb.ClearField("prompt_logprobs")
        pb.disable_speculation = not self.speculative
        pb.min_tokens = self.min_tokens
        if self.structured_output is not None:
            self.structured_output.to_pb(pb.structured_output)
        else:
            pb.ClearField("structured_output")
        if self.kv_eviction is not None:
            self.kv_eviction.to_pb(pb.kv_eviction)
        else:
            pb.ClearField("kv_eviction")
        if self.kv_compression is not None:
            self.kv_compression.to_pb(pb.kv_compression)
        else:
            pb.ClearField("kv_compression")
        return pb

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


def check_stop_sizes(num_stop: int, longest: int) -> None:
    if num_stop > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            "sampling.stop", f"{num_stop} stop strings; at most {MAX_STOP_STRINGS}"
        )
    if longest > MAX_STOP_STRING_CHARS:
        raise InvalidRequestError(
            "sampling.stop",
            f"a stop string of {longest} characters; at most {MAX_STOP_STRING_CHARS}",
        )

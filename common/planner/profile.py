"""WorkerProfile: how fast one engine worker is on its own hardware, and the fits the
planner and the simulator price work with.

A profile is measured on an idle engine (``common/engine/profiler.py``, ``pdserve profile``)
and holds for every worker with the same ``ProfileKey``: model, weight format, threads and
device. Two fits summarize the samples:

- prefill: ``ms(n new tokens after p cached) = base + per_token * n + per_attended * n * (p + n/2)``
  (the last term is attention: each new token reads the tokens before it);
- decode step: ``ms(b sequences of mean context c) = base + per_sequence * b + per_context * b * c``
  (the weights are read once a step; each row adds its own work and reads its own KV).

Both are least squares of the relative error with non-negative coefficients, so a fit is
as right for short work as for long, and never predicts that more work costs less. The profile travels as ``pdserve.common.v1.WorkerProfile`` and is stored as
JSON (a file, and Redis: ``common/index/profiles.py``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the engine builds profiles and imports no generated stub at run time
    from pdserve.common.v1.common_pb2 import WorkerProfile as WorkerProfilePb

PROFILE_FORMAT = 1  # the JSON's "format"; a reader refuses another


@dataclass(frozen=True)
class ProfileKey:
    """What a profile is of: every worker with the same key is as fast."""

    model: str
    weight_format: str = ""  # the weight format's KV identity; "" = float weights
    num_threads: int = 0  # 0 = the library's default
    device: str = "cpu"

    def slug(self) -> str:
        """A file- and key-safe name: ``model.weights.tN.device``."""
        parts = [self.model, self.weight_format or "float", f"t{self.num_threads}", self.device]
        return ".".join("".join(c if c.isalnum() or c in "-_" else "-" for c in p) for p in parts)


@dataclass(frozen=True)
class PrefillSample:
    prompt_tokens: int
    cached_tokens: int
    ms: float


@dataclass(frozen=True)
class DecodeSample:
    batch_size: int
    context_tokens: int  # per sequence
    step_ms: float


@dataclass(frozen=True)
class PrefillFit:
    base_ms: float = 0.0
    per_token_ms: float = 0.0
    per_attended_token_ms: float = 0.0

    def ms(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        if new_tokens <= 0:
            return 0.0
        attended = new_tokens * (cached_tokens + new_tokens / 2)
        return self.base_ms + self.per_token_ms * new_tokens + self.per_attended_token_ms * attended

    @classmethod
    def fit(cls, samples: list[PrefillSample]) -> PrefillFit:
        rows = [
            (1.0, s.prompt_tokens - s.cached_tokens,
             (s.prompt_tokens - s.cached_tokens) * (s.cached_tokens + (s.prompt_tokens - s.cached_tokens) / 2))
            for s in samples
        ]  # fmt: skip
        base, per_token, per_attended = _relative_fit(rows, [s.ms for s in samples])
        return cls(base, per_token, per_attended)

    def relative_errors(self, samples: Sequence[PrefillSample]) -> list[float]:
        """(predicted - measured) / measured per sample: how well the fit holds."""
        predicted = [self.ms(s.prompt_tokens - s.cached_tokens, s.cached_tokens) for s in samples]
        return _relative_errors(predicted, [s.ms for s in samples])


@dataclass(frozen=True)
class DecodeFit:
    base_ms: float = 0.0
    per_sequence_ms: float = 0.0
    per_context_token_ms: float = 0.0

    def step_ms(self, batch_size: float, context_tokens: float) -> float:
        """One step of ``batch_size`` sequences of mean context ``context_tokens``."""
        if batch_size <= 0:
            return 0.0
        return (
            self.base_ms
            + self.per_sequence_ms * batch_size
            + self.per_context_token_ms * batch_size * context_tokens
        )

    @classmethod
    def fit(cls, samples: list[DecodeSample]) -> DecodeFit:
        rows = [(1.0, s.batch_size, s.batch_size * s.context_tokens) for s in samples]
        base, per_sequence, per_context = _relative_fit(rows, [s.step_ms for s in samples])
        return cls(base, per_sequence, per_context)

    def relative_errors(self, samples: Sequence[DecodeSample]) -> list[float]:
        """(predicted - measured) / measured per sample: how well the fit holds."""
        predicted = [self.step_ms(s.batch_size, s.context_tokens) for s in samples]
        return _relative_errors(predicted, [s.step_ms for s in samples])


@dataclass(frozen=True)
class WorkerProfile:
    key: ProfileKey
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_samples: tuple[PrefillSample, ...] = ()
    decode_samples: tuple[DecodeSample, ...] = ()
    prefill_fit: PrefillFit = field(default_factory=PrefillFit)
    decode_fit: DecodeFit = field(default_factory=DecodeFit)
    measured_unix_ms: int = 0
    measure_ms: float = 0.0

    @classmethod
    def from_samples(
        cls,
        key: ProfileKey,
        *,
        block_size: int,
        num_kv_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        prefill_samples: list[PrefillSample],
        decode_samples: list[DecodeSample],
        measured_unix_ms: int = 0,
        measure_ms: float = 0.0,
    ) -> WorkerProfile:
        """The profile with both fits made from the samples."""
        if len(prefill_samples) < 3 or len(decode_samples) < 3:
            raise ValueError(
                f"a profile needs at least 3 prefill and 3 decode samples, got "
                f"{len(prefill_samples)} and {len(decode_samples)}"
            )
        return cls(
            key, block_size, num_kv_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
            tuple(prefill_samples), tuple(decode_samples),
            PrefillFit.fit(prefill_samples), DecodeFit.fit(decode_samples),
            measured_unix_ms, measure_ms,
        )  # fmt: skip

    # -- what the planner and the simulator ask ----------------------------------------------

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def prefill_ms(self, prompt_tokens: float, cached_tokens: float = 0.0) -> float:
        """A prompt's prefill on an idle worker (chunked as the engine chunks it: the fit is
        of whole prompts)."""
        cached = min(cached_tokens, max(prompt_tokens - 1, 0))
        return self.prefill_fit.ms(prompt_tokens - cached, cached)

    def decode_step_ms(self, batch_size: float, context_tokens: float) -> float:
        return self.decode_fit.step_ms(batch_size, context_tokens)

    # -- JSON and protobuf --------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> WorkerProfile:
        raw: dict[str, Any] = json.loads(text)
        if raw.get("format") != PROFILE_FORMAT:
            raise ValueError(
                f"profile format {raw.get('format')!r} is not {PROFILE_FORMAT}; measure it again"
            )
        return cls(
            key=ProfileKey(**raw["key"]),
            block_size=raw["block_size"],
            num_kv_blocks=raw["num_kv_blocks"],
            max_num_seqs=raw["max_num_seqs"],
            max_num_batched_tokens=raw["max_num_batched_tokens"],
            max_model_len=raw["max_model_len"],
            prefill_samples=tuple(PrefillSample(**s) for s in raw["prefill_samples"]),
            decode_samples=tuple(DecodeSample(**s) for s in raw["decode_samples"]),
            prefill_fit=PrefillFit(**raw["prefill_fit"]),
            decode_fit=DecodeFit(**raw["decode_fit"]),
            measured_unix_ms=raw["measured_unix_ms"],
            measure_ms=raw["measure_ms"],
        )

    def to_pb(self, message: WorkerProfilePb) -> None:
        """Fills ``message`` (a pdserve.common.v1.WorkerProfile)."""
        message.model = self.key.model
        message.weight_format = self.key.weight_format
        message.num_threads = self.key.num_threads
        message.device = self.key.device
        message.block_size = self.block_size
        message.num_kv_blocks = self.num_kv_blocks
        message.max_num_seqs = self.max_num_seqs
        message.max_num_batched_tokens = self.max_num_batched_tokens
        message.max_model_len = self.max_model_len
        for p in self.prefill_samples:
            message.prefill_samples.add(
                prompt_tokens=p.prompt_tokens, cached_tokens=p.cached_tokens, ms=p.ms
            )
        for d in self.decode_samples:
            message.decode_samples.add(
                batch_size=d.batch_size, context_tokens=d.context_tokens, step_ms=d.step_ms
            )
        fit = self.prefill_fit
        message.prefill_fit.base_ms = fit.base_ms
        message.prefill_fit.per_token_ms = fit.per_token_ms
        message.prefill_fit.per_attended_token_ms = fit.per_attended_token_ms
        step = self.decode_fit
        message.decode_fit.base_ms = step.base_ms
        message.decode_fit.per_sequence_ms = step.per_sequence_ms
        message.decode_fit.per_context_token_ms = step.per_context_token_ms
        message.measured_unix_ms = self.measured_unix_ms
        message.measure_ms = self.measure_ms

    @classmethod
    def from_pb(cls, message: WorkerProfilePb) -> WorkerProfile:
        return cls(
            key=ProfileKey(
                message.model, message.weight_format, message.num_threads, message.device
            ),
            block_size=message.block_size,
            num_kv_blocks=message.num_kv_blocks,
            max_num_seqs=message.max_num_seqs,
            max_num_batched_tokens=message.max_num_batched_tokens,
            max_model_len=message.max_model_len,
            prefill_samples=tuple(
                PrefillSample(p.prompt_tokens, p.cached_tokens, p.ms)
                for p in message.prefill_samples
            ),
            decode_samples=tuple(
                DecodeSample(d.batch_size, d.context_tokens, d.step_ms)
                for d in message.decode_samples
            ),
            prefill_fit=PrefillFit(
                message.prefill_fit.base_ms,
                message.prefill_fit.per_token_ms,
                message.prefill_fit.per_attended_token_ms,
            ),
            decode_fit=DecodeFit(
                message.decode_fit.base_ms,
                message.decode_fit.per_sequence_ms,
                message.decode_fit.per_context_token_ms,
            ),
            measured_unix_ms=message.measured_unix_ms,
            measure_ms=message.measure_ms,
        )


def _relative_fit(rows: Sequence[Sequence[float]], measured: Sequence[float]) -> list[float]:
    """Non-negative least squares of the relative errors, (predicted - measured) / measured:
    the planner's TTFT and ITL predictions need short steps as right as long ones, and in
    absolute terms the longest samples decide (on the 2-core machine's profiles of the
    default model that predicted a 1-sequence step 2x too slow; weighted, the worst
    relative error of a fit fell 1.2x to 7x)."""
    if any(m <= 0 for m in measured):
        raise ValueError(f"a profile sample must take some time, got {min(measured)} ms")
    weighted = [[x / m for x in row] for row, m in zip(rows, measured, strict=True)]
    return _nonnegative_lstsq(weighted, [1.0] * len(measured))


def _nonnegative_lstsq(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Least squares with every coefficient >= 0, exactly: the optimum is the unconstrained
    fit on its own support, so the best non-negative fit over every subset of the columns
    is it (8 small solves for 3 terms). Dropping the most negative coefficient until none
    is left missed the optimum on about 2 % of random 3-term problems, one of them with 3x
    its residual."""
    a = np.asarray(rows, dtype=np.float64)
    b = np.asarray(targets, dtype=np.float64)
    num_terms = a.shape[1]
    # Columns scaled to unit norm: their magnitudes differ by 10^6 (1 vs n * p).
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    scaled = a / scale
    best = np.zeros(num_terms)
    best_residual = float(np.linalg.norm(b))
    for size in range(1, num_terms + 1):
        for support in itertools.combinations(range(num_terms), size):
            columns = list(support)
            solved, *_ = np.linalg.lstsq(scaled[:, columns], b, rcond=None)
            if (solved < 0).any():
                continue
            coef = np.zeros(num_terms)
            coef[columns] = solved
            residual = float(np.linalg.norm(scaled @ coef - b))
            # Ties (a zero coefficient fitted either way) keep the smaller support.
            if residual < best_residual * (1 - 1e-12):
                best, best_residual = coef, residual
    return [float(c) for c in best / scale]


def _relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    return [(p - m) / m if m > 0 else 0.0 for p, m in zip(predicted, measured, strict=True)]

"""The analytic performance model: what a split would do under a load.

For a ``Split``, a ``WorkerProfile`` and a ``LoadForecast`` it predicts, per class of
request (prompt length x output length), the distribution of time to first token and of
mean time per output token after the first, and from them the percentiles and the share
of requests within both targets (attainment). How each part is priced:

1. Routing as the gateway does it (services/gateway/routing.py): a prompt whose uncached
   part is under ``local_prefill_tokens`` is prefilled by its decode worker, as is every
   prompt when there is no prefill worker (colocated).
2. Prefill workers: one M/G/c queue over the remote prompts' prefill times (their spread
   lengthens the queue, not only their mean; under load short prompts share a step and
   its base cost); TTFT = wait + prefill. The first token comes from the prefill worker;
   the KV transfer delays the second.
3. Decode workers: running rows per worker from Little's law solved with the step time
   (rows = rate x tokens x time per token), capped by max_num_seqs and the KV pool. Local
   prefills ride in the decode steps as chunks: a stream's time per token is the step plus
   the chunks that land in its steps (binomial over its tokens) -- the interference that
   makes disaggregation pay -- and a local prompt queues behind the others on its worker.
   The router's fewest-requests choice spares both while a worker is idle (Erlang B over
   the pool, ``pools.py``).
4. Hosts whose workers share cores (``Hosting``): each pool's speed from how often its
   host mates compute, solved with the pools' utilizations.
5. Overload: a pool past its capacity builds a queue over the horizon; arrivals are priced
   with the mean wait that queue causes, so "how far over" ranks splits that all fail.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.planner.forecast import LoadForecast
from common.planner.hosting import Hosting
from common.planner.pools import Correction, DecodePool, LoadClasses, PrefillPool
from common.planner.profile import WorkerProfile
from common.planner.queueing import binomial_cdf_table, table_at
from common.planner.types import Split, Targets

DEFAULT_LOCAL_PREFILL_TOKENS = 16  # services/gateway/config.py's default


@dataclass(frozen=True)
class ModelConfig:
    percentile: float = 0.9  # the share of requests the predicted latencies cover
    local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS
    kv_transfer_base_ms: float = 2.0
    kv_transfer_ms_per_token: float = 0.03  # ~46 KB/token at ~1.8 GB/s: this machine
    hosting: Hosting = field(default_factory=Hosting)
    horizon_s: float = 30.0  # the interval an overload is priced over
    # Requests queued now are to be served within this on top of the arrivals: long
    # enough that a transient queue does not make every split look overloaded.
    backlog_drain_s: float = 120.0
    kv_headroom: float = 0.9  # share of the KV pool the running rows may fill

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 1:
            raise ValueError(f"percentile must be in (0, 1), got {self.percentile}")
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")
        if self.kv_transfer_base_ms < 0 or self.kv_transfer_ms_per_token < 0:
            raise ValueError("KV transfer times must be >= 0")
        if self.horizon_s <= 0 or self.backlog_drain_s <= 0:
            raise ValueError(
                f"horizon_s and backlog_drain_s must be positive, got {self.horizon_s}, "
                f"{self.backlog_drain_s}"
            )
        if not 0 < self.kv_headroom <= 1:
            raise ValueError(f"kv_headroom must be in (0, 1], got {self.kv_headroom}")


@dataclass(frozen=True)
class Estimate:
    """A split's predicted shares within the targets: cheap, for searching splits."""

    split: Split
    attainment: float  # requests within both targets
    ttft_share: float  # requests within the TTFT target
    itl_share: float  # requests within the ITL target
    saturated: str  # "" or the pool that cannot keep up, and why
    prefill_utilization: float
    decode_batch: float  # mean running rows per decode worker
    decode_max_batch: float
    decode_load: float  # the decode workers' demand over their capacity

    @property
    def overload(self) -> float:
        """The busier pool's demand over its capacity: how far a failing split is from
        keeping up (what ranks splits when none keeps up)."""
        return max(self.prefill_utilization, self.decode_load)

    def meets(self, percentile: float, max_utilization: float = 1.0) -> bool:
        """Both targets at ``percentile``, with no pool busier than ``max_utilization``
        (headroom: near saturation a queue swings with every burst)."""
        return (
            self.ttft_share >= percentile
            and self.itl_share >= percentile
            and self.overload <= max_utilization
        )


@dataclass(frozen=True)
class Prediction:
    """An estimate with the percentiles and means the planner logs and learns from."""

    estimate: Estimate
    ttft_ms: float  # at the model's percentile
    itl_ms: float
    mean_ttft_ms: float
    mean_itl_ms: float  # per output token after the first, token-weighted (as a histogram)

    @property
    def split(self) -> Split:
        return self.estimate.split


class PerformanceModel:
    def __init__(self, profile: WorkerProfile, config: ModelConfig | None = None) -> None:
        self.profile = profile
        self.config = config or ModelConfig()

    def pricer(
        self, load: LoadForecast, targets: Targets, correction: Correction | None = None
    ) -> Pricer:
        """Prices splits under one load (pools memoized: a search prices many splits)."""
        return Pricer(self, load, targets, correction or Correction())

    def predict(
        self,
        split: Split,
        load: LoadForecast,
        targets: Targets,
        correction: Correction | None = None,
    ) -> Prediction:
        return self.pricer(load, targets, correction).predict(split)


@dataclass(frozen=True)
class _Priced:
    """Per-class probabilities of one split."""

    estimate: Estimate
    ttft_cdf_at: Callable[[np.ndarray], np.ndarray]  # t [I] -> P(TTFT_i <= t) [I]
    itl_base: np.ndarray  # [I, J] time per token without chunk interference
    pools: tuple[PrefillPool, DecodePool]


class Pricer:
    def __init__(
        self, model: PerformanceModel, load: LoadForecast, targets: Targets, correction: Correction
    ) -> None:
        self.model = model
        self.targets = targets
        self.correction = correction
        c = model.config
        self.load = LoadClasses.of(
            load, model.profile, backlog_drain_s=c.backlog_drain_s,
            kv_transfer_base_ms=c.kv_transfer_base_ms,
            kv_transfer_ms_per_token=c.kv_transfer_ms_per_token,
        )  # fmt: skip
        self._prefill = functools.lru_cache(maxsize=None)(self._price_prefill)
        self._decode = functools.lru_cache(maxsize=None)(self._price_decode)
        self._binomial = functools.lru_cache(maxsize=None)(binomial_cdf_table)

    # -- pools ----------------------------------------------------------------------------

    def _price_prefill(self, servers: int, speed: float) -> PrefillPool:
        remote = ~self.load.local_mask(servers == 0, self.model.config.local_prefill_tokens)
        return PrefillPool.price(
            self.load, remote, servers, self.model.profile, speed, self.correction,
            self.model.config.horizon_s,
        )  # fmt: skip

    def _price_decode(self, workers: int, colocated: bool, speed: float) -> DecodePool:
        c = self.model.config
        return DecodePool.price(
            self.load, self.load.local_mask(colocated, c.local_prefill_tokens), workers,
            self.model.profile, speed, self.correction,
            horizon_s=c.horizon_s, kv_headroom=c.kv_headroom,
        )  # fmt: skip

    def _pools(self, split: Split) -> tuple[PrefillPool, DecodePool]:
        hosting = self.model.config.hosting
        speed_p = speed_d = 1.0
        prefill = self._prefill(split.prefill, speed_p)
        decode = self._decode(split.decode, split.colocated, speed_d)
        if not hosting.shared:
            return prefill, decode
        n = split.total
        for _ in range(8):  # speeds and utilizations settle together
            busy_p, busy_d = min(prefill.utilization, 1.0), decode.busy
            others_p = ((split.prefill - 1) * busy_p + split.decode * busy_d) / max(n - 1, 1)
            others_d = (split.prefill * busy_p + (split.decode - 1) * busy_d) / max(n - 1, 1)
            new_p = hosting.mean_speed(others_p, n)
            new_d = hosting.mean_speed(others_d, n)
            # Rounded so that the memo hits once the iteration has settled.
            speed_p = round((speed_p + new_p) / 2, 3)
            speed_d = round((speed_d + new_d) / 2, 3)
            prefill = self._prefill(split.prefill, speed_p)
            decode = self._decode(split.decode, split.colocated, speed_d)
        return prefill, decode

    # -- per class ------------------------------------------------------------------------

    def _price(self, split: Split) -> _Priced:
        load, c = self.load, self.model.config
        prefill, decode = self._pools(split)
        local = load.local_mask(split.colocated, c.local_prefill_tokens)

        def ttft_cdf_at(t: np.ndarray) -> np.ndarray:
            remote_cdf = prefill.wait.cdf(t - prefill.service_ms)
            local_cdf = decode.local_wait.cdf(t - decode.local_ttft_ms)
            return np.where(local, local_cdf, remote_cdf)

        # The gap between the first token (from the prefill worker) and the second: the KV
        # transfer, the rest of the step in progress, a place in the batch.
        first_gap = np.where(
            local, 0.0, load.transfer_ms + decode.step_ms / 2 + decode.admission_ms
        )  # [I]
        steps = np.maximum(load.decode_steps, 1.0)  # [J]
        itl_base = decode.step_ms + first_gap[:, None] / steps[None, :]  # [I, J]
        ttft_share_i = ttft_cdf_at(np.full_like(load.prompt, self.targets.ttft_ms))
        itl_within = self._itl_cdf(decode, itl_base, self.targets.itl_ms)  # [I, J]
        pw, ow = load.prompt_weight, load.output_weight
        estimate = Estimate(
            split=split,
            attainment=float(pw @ (ttft_share_i[:, None] * itl_within) @ ow),
            ttft_share=float(pw @ ttft_share_i),
            itl_share=float(pw @ itl_within @ ow),
            saturated=_saturation(prefill, decode, split),
            prefill_utilization=prefill.utilization,
            decode_batch=decode.batch,
            decode_max_batch=decode.max_batch,
            decode_load=decode.load,
        )
        return _Priced(estimate, ttft_cdf_at, itl_base, (prefill, decode))

    def _itl_cdf(self, decode: DecodePool, itl_base: np.ndarray, t_ms: float) -> np.ndarray:
        """[I, J] P(time per token <= t): K of a stream's m steps carry a chunk,
        K ~ Binomial(m, the pool's chunk share for m steps), each adding chunk_ms / m."""
        steps = self.load.decode_steps
        out = np.empty_like(itl_base)
        for j, m in enumerate(steps):
            if m < 1:
                out[:, j] = 1.0  # one token: no time per token to miss
                continue
            slack = t_ms - itl_base[:, j]
            share = decode.chunk_share(m)
            if share <= 0:
                out[:, j] = np.where(slack >= 0, 1.0, 0.0)
                continue
            allowed = np.where(slack >= 0, slack * m / decode.chunk_ms, -1.0)
            out[:, j] = table_at(self._binomial(int(m), round(share, 4)), allowed)
        return out

    # -- what the planner asks --------------------------------------------------------------

    def estimate(self, split: Split) -> Estimate:
        return self._price(split).estimate

    def predict(self, split: Split) -> Prediction:
        priced = self._price(split)
        load, q = self.load, self.model.config.percentile
        pw, ow = load.prompt_weight, load.output_weight
        _, decode = priced.pools

        def ttft_share(t: float) -> float:
            return float(pw @ priced.ttft_cdf_at(np.full_like(load.prompt, t)))

        def itl_share(t: float) -> float:
            return float(pw @ self._itl_cdf(decode, priced.itl_base, t) @ ow)

        # The histogram's mean: over tokens, so long outputs weigh more.
        steps = load.decode_steps
        token_weight = ow * steps
        chunks = np.array([decode.chunk_share(m) * decode.chunk_ms for m in steps])  # [J]
        if token_weight.sum() > 0:
            per_class = pw @ priced.itl_base + chunks  # [J]
            mean_itl = float(per_class @ token_weight) / float(token_weight.sum())
        else:
            mean_itl = 0.0
        return Prediction(
            estimate=priced.estimate,
            ttft_ms=_quantile(ttft_share, q),
            itl_ms=_quantile(itl_share, q),
            mean_ttft_ms=self._mean_ttft(priced),
            mean_itl_ms=mean_itl,
        )

    def _mean_ttft(self, priced: _Priced) -> float:
        load = self.load
        prefill, decode = priced.pools
        split = priced.estimate.split
        local = load.local_mask(split.colocated, self.model.config.local_prefill_tokens)
        remote_ttft = prefill.wait.mean_ms + prefill.service_ms
        local_ttft = decode.local_wait.mean_ms + decode.local_ttft_ms
        return float(load.prompt_weight @ np.where(local, local_ttft, remote_ttft))


def _saturation(prefill: PrefillPool, decode: DecodePool, split: Split) -> str:
    parts = []
    if prefill.utilization >= 1:
        parts.append(f"prefill at {prefill.utilization:.2f}x its capacity")
    if decode.saturated:
        parts.append(f"decode out of {decode.saturated}")
    return "; ".join(parts)


def _quantile(f: Callable[[float], float], q: float) -> float:
    """The least t (ms, to 0.5 %) with f(t) >= q, f a non-decreasing share within t."""
    lo, hi = 0.0, 1.0
    while f(hi) < q:
        lo, hi = hi, hi * 4
        if hi > 1e9:
            return math.inf
    for _ in range(60):
        if hi - lo <= max(hi * 0.005, 1e-3):
            break
        mid = (lo + hi) / 2
        if f(mid) >= q:
            hi = mid
        else:
            lo = mid
    return hi

"""Expert load in Redis: workers publish tokens routed per layer and expert, at an interval,
into rolling windows plus totals; ``pdserve experts`` reads and adds them up.

Layout (keys built in common/index/keys.py): per model, worker and MoE layer, one hash per
time window (``bucket = unix_ms // window_ms``), fields ``p{e}``/``d{e}`` = tokens routed to
expert ``e`` during prefill/decode in that window, HINCRBY'd by each publish that falls in
it; each window hash expires ``windows`` windows after it ends, so at most ``windows + 1``
exist per worker and layer. A ``total`` hash holds the same fields since the worker started,
and a ``meta`` hash the worker's layers and window settings; both under a TTL refreshed
on every publish, so a worker that is gone fades away.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from common.experts.counts import DECODE, PHASES, PREFILL, ExpertCounts
from common.index import keys

DEFAULT_WINDOW_S = 60.0
DEFAULT_WINDOWS = 60  # an hour of one-minute windows
DEFAULT_TTL_S = 24 * 3600  # totals and meta of a worker that stopped publishing


@dataclass
class LayerLoad:
    """One layer's load across the workers read: per phase, count vectors of the live
    windows (oldest first, one per window bucket, zeros where nothing was published) and
    the totals since each worker started."""

    layer: int
    num_experts: int
    buckets: list[int]
    windows: list[list[list[int]]]  # [phase][window][expert]
    totals: list[list[int]]  # [phase][expert]

    def window_counts(self, phase: str = "all") -> list[list[int]]:
        """Per window (oldest first), the counts of ``phase`` (prefill, decode or all)."""
        if phase == "all":
            return [
                [a + b for a, b in zip(p, d, strict=True)]
                for p, d in zip(self.windows[PREFILL], self.windows[DECODE], strict=True)
            ]
        return [list(w) for w in self.windows[PHASES.index(phase)]]

    def total_counts(self, phase: str = "all") -> list[int]:
        if phase == "all":
            return [a + b for a, b in zip(self.totals[PREFILL], self.totals[DECODE], strict=True)]
        return list(self.totals[PHASES.index(phase)])


@dataclass
class ModelLoad:
    model: str
    workers: list[str]
    window_ms: int
    num_windows: int
    layers: dict[int, LayerLoad] = field(default_factory=dict)
    # Workers left out of the windows (their window length differs); totals still count.
    other_window_workers: list[str] = field(default_factory=list)


class ExpertLoadStore:
    def __init__(
        self,
        redis: Any,
        model: str,
        window_s: float = DEFAULT_WINDOW_S,
        num_windows: int = DEFAULT_WINDOWS,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        if window_s <= 0 or num_windows < 1 or ttl_s <= 0:
            raise ValueError("window_s and ttl_s must be positive and num_windows at least 1")
        self.redis = redis
        self.model = model
        self.window_ms = max(1, round(window_s * 1000))
        self.num_windows = num_windows
        self.ttl_ms = max(self.window_ms * (num_windows + 1), round(ttl_s * 1000))

    def bucket(self, now_ms: int) -> int:
        return now_ms // self.window_ms

    async def publish(self, worker_id: str, delta: ExpertCounts, now_s: float | None = None) -> int:
        """Adds ``delta`` (tokens routed since the last publish) to the current window and
        the totals, in one round trip. Returns how many (phase, layer, expert) counts
        were non-zero."""
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        bucket = self.bucket(now_ms)
        expire_at_ms = (bucket + 1 + self.num_windows) * self.window_ms
        pipe = self.redis.pipeline(transaction=False)
        written = 0
        for slot, layer in enumerate(delta.layers):
            fields: dict[str, int] = {}
            for phase in (PREFILL, DECODE):
                for expert, count in enumerate(delta.counts[phase][slot]):
                    if count:
                        fields[keys.expert_field(phase, expert)] = count
            if not fields:
                continue
            written += len(fields)
            window = keys.expert_window(self.model, worker_id, layer, bucket)
            total = keys.expert_total(self.model, worker_id, layer)
            for name, count in fields.items():
                pipe.hincrby(window, name, count)
                pipe.hincrby(total, name, count)
            pipe.pexpireat(window, expire_at_ms)
            pipe.pexpire(total, self.ttl_ms)
        meta = keys.expert_meta(self.model, worker_id)
        pipe.hset(
            meta,
            mapping={
                "layers": ",".join(str(layer) for layer in delta.layers),
                "num_experts": str(delta.num_experts),
                "window_ms": str(self.window_ms),
                "windows": str(self.num_windows),
                "updated_ms": str(now_ms),
            },
        )
        pipe.pexpire(meta, self.ttl_ms)
        pipe.zadd(keys.expert_workers(self.model), {worker_id: now_ms})
        pipe.pexpire(keys.expert_workers(self.model), self.ttl_ms)
        pipe.zadd(keys.expert_models(), {self.model: now_ms})
        pipe.pexpire(keys.expert_models(), self.ttl_ms)
        await pipe.execute()
        return written

    async def read(self, now_s: float | None = None) -> ModelLoad:
        """Every live worker's windows and totals for this model, added up per layer."""
        return await read_model(self.redis, self.model, now_s)


async def models(redis: Any, now_s: float | None = None) -> list[str]:
    """Models whose workers published expert load recently (within the TTL)."""
    now_ms = int((time.time() if now_s is None else now_s) * 1000)
    raw = await redis.zrangebyscore(keys.expert_models(), now_ms - DEFAULT_TTL_S * 1000, "+inf")
    return sorted(_text(m) for m in raw)


async def read_model(redis: Any, model: str, now_s: float | None = None) -> ModelLoad:
    now_ms = int((time.time() if now_s is None else now_s) * 1000)
    worker_ids = sorted(_text(w) for w in await redis.zrange(keys.expert_workers(model), 0, -1))
    pipe = redis.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.hgetall(keys.expert_meta(model, worker_id))
    metas: dict[str, dict[str, str]] = {}
    gone: list[str] = []
    for worker_id, raw in zip(worker_ids, await pipe.execute(), strict=True):
        if raw:
            metas[worker_id] = {_text(k): _text(v) for k, v in raw.items()}
        else:
            gone.append(worker_id)
    if gone:
        await redis.zrem(keys.expert_workers(model), *gone)
    if not metas:
        return ModelLoad(model, [], 0, 0)

    # Windows add up across workers only for one window length: the most common one.
    lengths = Counter((int(m["window_ms"]), int(m["windows"])) for m in metas.values())
    (window_ms, num_windows), _ = lengths.most_common(1)[0]
    result = ModelLoad(model, sorted(metas), window_ms, num_windows)
    current = now_ms // window_ms
    buckets = list(range(current - num_windows, current + 1))

    plan: list[tuple[str, int, int, int | None]] = []  # (worker, layer, experts, bucket|None)
    pipe = redis.pipeline(transaction=False)
    for worker_id, meta in metas.items():
        same = (int(meta["window_ms"]), int(meta["windows"])) == (window_ms, num_windows)
        if not same:
            result.other_window_workers.append(worker_id)
        num_experts = int(meta["num_experts"])
        for layer in _layers(meta.get("layers", "")):
            pipe.hgetall(keys.expert_total(model, worker_id, layer))
            plan.append((worker_id, layer, num_experts, None))
            if same:
                for bucket in buckets:
                    pipe.hgetall(keys.expert_window(model, worker_id, layer, bucket))
                    plan.append((worker_id, layer, num_experts, bucket))
    replies = await pipe.execute()
    for (_, layer, num_experts, window), raw in zip(plan, replies, strict=True):
        entry = result.layers.get(layer)
        if entry is None:
            entry = result.layers[layer] = LayerLoad(
                layer,
                num_experts,
                buckets,
                [[[0] * num_experts for _ in buckets] for _ in PHASES],
                [[0] * num_experts for _ in PHASES],
            )
        if num_experts != entry.num_experts:
            raise ValueError(
                f"workers of {model} disagree on layer {layer}'s expert count "
                f"({num_experts} vs {entry.num_experts})"
            )
        target_index = None if window is None else buckets.index(window)
        for name, value in raw.items():
            parsed = keys.parse_expert_field(_text(name))
            if parsed is None or not 0 <= parsed[1] < num_experts:
                continue
            phase, expert = parsed
            if target_index is None:
                entry.totals[phase][expert] += int(value)
            else:
                entry.windows[phase][target_index][expert] += int(value)
    result.layers = dict(sorted(result.layers.items()))
    return result


def _layers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def planner_load(layer: LayerLoad, phase: str = "all", source: str = "windows") -> list[int]:
    """The load vector a placement plan balances: the live windows added up (recent
    traffic), or the totals; falls back to the totals when the windows are empty."""
    if source not in ("windows", "total"):
        raise ValueError(f"source must be windows or total, got {source!r}")
    if source == "windows":
        windows = layer.window_counts(phase)
        summed = [sum(col) for col in zip(*windows, strict=True)] if windows else []
        if summed and sum(summed) > 0:
            return summed
    return layer.total_counts(phase)

"""Factories the planner's tests share: windows of a given load, and profiles (no torch)."""

from __future__ import annotations

import numpy as np

from common.planner.profile import DecodeSample, PrefillSample, ProfileKey, WorkerProfile
from common.planner.types import Distribution, LoadWindow

INTERVAL_S = 30.0


def window(
    start_s: float,
    rate: float,
    prompt_tokens: float,
    output_tokens: float,
    *,
    hit_rate: float = 0.0,
    waiting: int = 0,
    ttft_ms: Distribution | None = None,
    itl_ms: Distribution | None = None,
    seconds: float = INTERVAL_S,
) -> LoadWindow:
    """A window of ``rate`` requests/s, every one of the given lengths."""
    n = round(rate * seconds)
    return LoadWindow(
        start_s=start_s,
        end_s=start_s + seconds,
        num_arrivals=n,
        prompt_tokens=Distribution.of([prompt_tokens], [max(n, 1)]),
        output_tokens=Distribution.of([output_tokens], [max(n, 1)]),
        prefix_hit_rate=hit_rate,
        num_waiting=waiting,
        ttft_ms=ttft_ms or Distribution(),
        itl_ms=itl_ms or Distribution(),
    )


def noisy_window(
    rng: np.random.Generator,
    start_s: float,
    rate: float,
    prompt_tokens: float,
    output_tokens: float,
    seconds: float = INTERVAL_S,
) -> LoadWindow:
    """Poisson arrivals; lengths spread +-30 % around the given ones."""
    n = int(rng.poisson(rate * seconds))
    prompts = rng.uniform(0.7, 1.3, size=max(n, 1)) * prompt_tokens
    outputs = rng.uniform(0.7, 1.3, size=max(n, 1)) * output_tokens
    return LoadWindow(
        start_s, start_s + seconds, n,
        Distribution.of(np.round(prompts)).compact(16),
        Distribution.of(np.round(outputs)).compact(16),
    )  # fmt: skip


def fitted_profile(
    prefill: tuple[float, float, float],
    decode: tuple[float, float, float],
    *,
    num_kv_blocks: int = 4096,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
) -> WorkerProfile:
    """A profile whose fits are exactly ``prefill`` (base, per token, per attended pair)
    and ``decode`` (base, per row, per context token)."""
    pb, pt, pa = prefill
    db, dr, dc = decode
    prefill_samples = [
        PrefillSample(n, c, pb + pt * (n - c) + pa * (n - c) * (c + (n - c) / 2))
        for n, c in ((64, 0), (512, 0), (2048, 0), (2048, 1024), (4096, 0))
    ]
    decode_samples = [
        DecodeSample(b, ctx, db + dr * b + dc * b * ctx)
        for b, ctx in ((1, 100), (8, 500), (32, 1000), (64, 200))
    ]
    return WorkerProfile.from_samples(
        ProfileKey("test-model"),
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=16384,
        prefill_samples=prefill_samples,
        decode_samples=decode_samples,
    )


def accelerator_profile() -> WorkerProfile:
    """Prefill ~14k tokens/s with a 20 ms base; a 7 ms decode step plus 0.05 ms a row."""
    return fitted_profile(
        (20.0, 0.07, 2.5e-6), (7.0, 0.05, 3.8e-5),
        num_kv_blocks=27000, max_num_seqs=256, max_num_batched_tokens=8192,
    )  # fmt: skip

"""Expert-load figures from tokens-routed counts: imbalance, hottest experts, trend.

Pure Python (no torch): ``pdserve experts`` and the Prometheus collector use it.

- imbalance: max / mean of the tokens routed per expert (1.0 = perfectly even; with E
  experts the worst is E, every token on one expert). It is the barrel-effect factor: the
  hottest expert's work relative to an even spread.
- cv: coefficient of variation, population std / mean.
- trend: the recent half of the windows against the older half.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def imbalance(counts: Sequence[float]) -> float:
    """max / mean; 0.0 when nothing was routed (no load, no imbalance to speak of)."""
    total = sum(counts)
    if not counts or total <= 0:
        return 0.0
    return max(counts) / (total / len(counts))


def coefficient_of_variation(counts: Sequence[float]) -> float:
    total = sum(counts)
    if not counts or total <= 0:
        return 0.0
    mean = total / len(counts)
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts)) / mean


def hottest(counts: Sequence[float], top: int) -> list[dict[str, Any]]:
    """The ``top`` experts by tokens routed: expert, tokens, share of the layer's tokens."""
    total = sum(counts) or 1
    ranked = sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:top]
    return [
        {"expert": e, "tokens": int(counts[e]), "share": round(counts[e] / total, 4)}
        for e in ranked
        if counts[e] > 0
    ]


def add(rows: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sum of equally long count vectors (no rows: an empty vector)."""
    if not rows:
        return []
    return [sum(column) for column in zip(*rows, strict=True)]


def trend(windows: Sequence[Sequence[int]], top: int) -> dict[str, Any]:
    """Recent vs older load, from count vectors ordered oldest first.

    Leading windows with no traffic (before the workers started) are left out; the rest
    split in two halves (the middle one, for an odd count, goes to neither): the imbalance
    of each half, and for the experts hottest in the recent half, their share of the
    layer's tokens then and now.
    """
    first = next((i for i, w in enumerate(windows) if any(w)), len(windows))
    windows = windows[first:]
    half = len(windows) // 2
    if half == 0:
        return {"windows": len(windows), "comparable": False}
    older, recent = add(windows[:half]), add(windows[len(windows) - half :])
    older_total, recent_total = sum(older), sum(recent)
    if older_total == 0 or recent_total == 0:
        return {"windows": len(windows), "comparable": False}
    experts = []
    for row in hottest(recent, top):
        e = row["expert"]
        before = older[e] / older_total
        experts.append(
            {
                "expert": e,
                "share_older": round(before, 4),
                "share_recent": row["share"],
                "change": round(row["share"] - before, 4),
            }
        )
    return {
        "windows": len(windows),
        "comparable": True,
        "imbalance_older": round(imbalance(older), 4),
        "imbalance_recent": round(imbalance(recent), 4),
        "tokens_older": older_total,
        "tokens_recent": recent_total,
        "experts": experts,
    }


def summarize_layer(
    layer: int, windows: Sequence[Sequence[int]], totals: Sequence[int], top: int = 5
) -> dict[str, Any]:
    """One layer's figures for ``pdserve experts``: over the live windows (oldest first)
    and over the totals since the workers started publishing."""
    recent = add(windows) if windows else [0] * len(totals)
    return {
        "layer": layer,
        "tokens": sum(recent),
        "imbalance": round(imbalance(recent), 4),
        "cv": round(coefficient_of_variation(recent), 4),
        "hottest": hottest(recent, top),
        "trend": trend(windows, top),
        "total_tokens": sum(totals),
        "total_imbalance": round(imbalance(totals), 4),
        "total_cv": round(coefficient_of_variation(totals), 4),
        "counts": list(recent),
    }

"""How many proposals are worth verifying: per request and per step, from what they cost.

A verify row is not free where the step is compute-bound (a CPU: on the 2-core test
machine each extra row of the packed int4 kernel costs ~2.1 ms against ~8 ms for a whole
one-row step, and a batch of 16 already pays per row). Verifying guess j of a request
yields a token only if guesses 1..j are all kept: probability ``alpha ** j`` for a request
whose guesses are kept with probability ``alpha``. The row is worth it when that expected
token per row-cost beats what the step makes anyway, tokens per millisecond:

    alpha ** j / row_ms >= batch / step_ms(batch)

so guesses are verified up to ``j = floor(log(row_ms * batch / step_ms) / log(alpha))``
(capped at ``num_speculative_tokens``). Both sides are measured, not assumed:

- ``StepCost`` fits ``step_ms(rows) = base + row_ms * rows`` to the decode steps the engine
  ran (exponentially weighted least squares, so it follows the machine's drift); until the
  steps seen span two row counts it takes ``row_ms = PRIOR_ROW_FRACTION * base``.
- ``Acceptance`` is a request's own rate: kept / (kept + rejected) over its rounds (a round
  rejects at most once), exponentially weighted, starting from a prior that lets a new
  request try a few guesses.

On a machine where rows cost nearly nothing (a GPU at small batch) the bound is reached
at any alpha and every guess is verified; on open chat, where guesses are rarely kept,
requests stop proposing after a few rounds and decode as if speculation were off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Before the fit has two row counts: an extra row costs this share of a one-row step.
PRIOR_ROW_FRACTION = 0.3
# Step-cost samples and acceptance rounds lose this share of weight per new one.
DECAY = 0.05
# A request's acceptance before its first round: kept / (kept + rejected) = 3 / 4.
PRIOR_KEPT, PRIOR_REJECTED = 1.5, 0.5


class StepCost:
    """Milliseconds of a decode step as a line in its row count, fitted as steps run."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, rows: int, ms: float) -> None:
        keep = 1.0 - self.decay
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + rows
        self._y = self._y * keep + ms
        self._xx = self._xx * keep + rows * rows
        self._xy = self._xy * keep + rows * ms

    @property
    def known(self) -> bool:
        return self._w > 0.0

    def line(self) -> tuple[float, float]:
        """(base_ms, row_ms); (0, 0) before any step."""
        if not self._w:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > 0.05:  # the steps seen differ in rows: the slope is measured
            slope = (self._xy / self._w - mean_x * mean_y) / var
            slope = max(slope, 0.0)
            return max(mean_y - slope * mean_x, 0.0), slope
        one_row = mean_y / (1.0 + PRIOR_ROW_FRACTION * (mean_x - 1.0))
        return one_row * (1.0 - PRIOR_ROW_FRACTION), one_row * PRIOR_ROW_FRACTION

    def ms(self, rows: int) -> float:
        base, row = self.line()
        return base + row * rows


@dataclass
class Acceptance:
    """One request's rate of kept guesses, exponentially weighted over its rounds."""

    kept: float = PRIOR_KEPT
    rejected: float = PRIOR_REJECTED

    def add(self, num_proposed: int, num_kept: int) -> None:
        keep = (1.0 - DECAY) ** max(num_proposed, 1)
        self.kept = self.kept * keep + num_kept
        self.rejected = self.rejected * keep + (1 if num_kept < num_proposed else 0)

    def idle(self) -> None:
        """A step without a round: the rate drifts back towards the prior, so a request
        that stopped proposing tries again some tokens later (its text may have turned
        to copying)."""
        self.kept += (PRIOR_KEPT - self.kept) * DECAY
        self.rejected += (PRIOR_REJECTED - self.rejected) * DECAY

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.rejected)


def worth_verifying(alpha: float, batch: int, cost: StepCost, limit: int) -> int:
    """Guesses worth verifying for a request kept at rate ``alpha`` in a step of ``batch``
    sequences (module docstring), at most ``limit``."""
    if limit <= 0 or alpha <= 0.0:
        return 0
    if not cost.known:
        return limit
    _, row_ms = cost.line()
    step_ms = cost.ms(max(batch, 1))
    if row_ms <= 0.0 or step_ms <= 0.0:
        return limit
    bound = row_ms * max(batch, 1) / step_ms  # alpha ** j must reach this
    if bound >= 1.0:
        return 0
    if alpha >= 1.0:
        return limit
    return max(0, min(limit, math.floor(math.log(bound) / math.log(alpha))))

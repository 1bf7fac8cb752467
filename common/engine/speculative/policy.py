"""How many proposals are worth verifying: per request and per step, from what they cost.

A verify row is not free where the step is compute-bound (a CPU: on the 2-core test
machine each extra row of the packed int4 kernel costs ~2.1 ms against ~8 ms for a whole
one-row step, and a batch of 16 already pays per row). Verifying guess j of a request
yields a token only if guesses 1..j are all kept: probability ``alpha ** j`` for a request
whose guesses are kept with probability ``alpha``. The row is worth it when that expected
token per row-cost beats what the step makes anyway, tokens per millisecond:

    alpha ** j / row_ms >= batch / step_ms(batch)

(for a cost linear in the rows, guesses up to ``j = floor(log(row_ms * batch / step_ms) /
log(alpha))``); in general the guesses of the whole step are granted best first, while a
guess's expected token at the step's own time per token beats what its row adds
(``allocate``). Both sides are measured, not assumed:

- ``StepCost`` keeps the mean milliseconds of each row count of the decode steps the engine
  ran (exponentially weighted, so it follows the machine's drift), and for counts not yet
  seen a line fitted to all of them (weighted least squares; until the steps span two row
  counts, ``row_ms = PRIOR_ROW_FRACTION * base``). A batch of ``LINE_BATCH`` sequences or
  more prices its rows by the line alone: its row counts are each seen a few times, with
  contexts of every length, and the difference of two neighbouring means is noise (a copy
  run at concurrency 16 on the 2-core machine: ms(17) - ms(16) from -1.8 to 3.6 ms while
  the slope was 1.2), which granted a free-looking row or refused every guess by turns.
- ``Acceptance`` is a request's own rate: kept / (kept + rejected) over its rounds (a round
  rejects at most once), exponentially weighted, starting from a prior that lets a new
  request try a few guesses.

On a machine where rows cost nearly nothing (a GPU at small batch) the bound is reached
at any alpha and every guess is verified; on open chat, where guesses are rarely kept,
requests stop proposing after a few rounds and decode as if speculation were off.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# Before the fit has two row counts: an extra row costs this share of a one-row step.
PRIOR_ROW_FRACTION = 0.3
# Step-cost samples and acceptance rounds lose this share of weight per new one.
DECAY = 0.05
# A request's acceptance before its first round: kept / (kept + rejected) = 3 / 4.
PRIOR_KEPT, PRIOR_REJECTED = 1.5, 0.5
# From this many sequences in a step, rows are priced by the fitted line (module docstring).
LINE_BATCH = 8


class StepCost:
    """Milliseconds of a decode step by its row count, measured as steps run: the mean of
    each row count seen at least ``MIN_SEEN`` times (a kernel's cost is not a line: on the
    test machine the second row costs 0.47 of a one-row step, the fifth almost nothing,
    its tiles hold 4 rows), else a line fitted to all of them."""

    MIN_SEEN = 3

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._by_rows: dict[int, tuple[float, int]] = {}  # rows -> (mean ms, times seen)

    def add(self, rows: int, ms: float) -> None:
        keep = 1.0 - self.decay
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + rows
        self._y = self._y * keep + ms
        self._xx = self._xx * keep + rows * rows
        self._xy = self._xy * keep + rows * ms
        mean, seen = self._by_rows.get(rows, (ms, 0))
        weight = max(self.decay, 1.0 / (seen + 1))
        self._by_rows[rows] = (mean + (ms - mean) * weight, seen + 1)

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

    def ms(self, rows: int, line_only: bool = False) -> float:
        mean, seen = self._by_rows.get(rows, (0.0, 0))
        if seen >= self.MIN_SEEN and not line_only:
            return mean
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


def allocate(asks: list[tuple[float, int]], batch: int, cost: StepCost) -> list[int]:
    """Guesses worth verifying this step for each request, from (its kept rate alpha, at
    most this many) and the step's ``batch`` sequences. Guess j of a request yields alpha^j
    tokens, each worth what the step spends per token, step_ms(batch) / batch; guesses are
    granted best first while that beats the next row's cost, step_ms(rows + 1) - step_ms
    (rows), at the rows granted so far: a large compute-bound batch, whose rows all cost,
    verifies only its near-certain guesses. From ``LINE_BATCH`` sequences every cost is the
    line's."""
    granted = [0] * len(asks)
    if not asks:
        return granted
    if not cost.known:
        return [max(0, limit) for _, limit in asks]
    batch = max(batch, 1)
    line_only = batch >= LINE_BATCH
    step_ms = cost.ms(batch, line_only)
    if step_ms <= 0.0:
        return [max(0, limit) for _, limit in asks]
    per_token = step_ms / batch
    # (-value of the request's next guess, request): a request's guesses are worth less
    # and less, so each is granted a prefix.
    heap = [(-alpha, i) for i, (alpha, limit) in enumerate(asks) if alpha > 0.0 and limit > 0]
    heapq.heapify(heap)
    rows = batch
    while heap:
        value, i = heap[0]
        if -value * per_token < cost.ms(rows + 1, line_only) - cost.ms(rows, line_only):
            break
        heapq.heappop(heap)
        granted[i] += 1
        rows += 1
        alpha, limit = asks[i]
        if granted[i] < limit:
            heapq.heappush(heap, (value * alpha, i))
    return granted


def worth_verifying(alpha: float, batch: int, cost: StepCost, limit: int) -> int:
    """``allocate`` for one request."""
    return allocate([(alpha, limit)], batch, cost)[0]

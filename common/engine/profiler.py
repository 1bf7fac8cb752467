"""measure_profile: how fast this engine is on its own hardware, as a ``WorkerProfile``
(common/planner/profile.py) for the planner and the simulator (issue 29).

It drives ``Engine.add_request`` / ``Engine.step`` itself, on an idle engine, in three
phases, each point capped by what the engine holds (max_model_len, KV blocks, max_num_seqs,
max_num_batched_tokens):

1. cold prefill: random token ids under a fresh cache salt each (no prefix hit), timed from
   ``add_request`` to the first token, chunked as the engine chunks (max_num_batched_tokens);
2. cached prefill: a prompt whose first p tokens hit the prefix cache. The prefix gets
   there without being computed: a seed request imports random KV for it (``kv_import``)
   and computes one token, which publishes its p / S full blocks; the timed request, under
   the same salt, hits them;
3. decode: b sequences whose c tokens of context are imported the same way (a memory copy
   instead of b * c tokens of prefill), then ``warmup_steps`` steps dropped and the median
   of ``timed_steps`` steps recorded. Speculation is off for them: a sample is a plain step.

Within a phase the points run cheapest first, and once the next one would end past the
phase's share of ``budget_s`` the rest are left out (never below 3 samples a phase), so a
slow engine (a big model on a small machine) still profiles in about the budget. At the
end the first point is timed again: more than 30 % off, the machine's speed changed while
it was measured (other work on its cores) and a warning says the samples disagree.

The engine is left as it was found: every request it added finished (aborted if a step
raised) and its blocks freed; its prompts' blocks forgotten by the prefix cache (and by the
evictions a worker reports: nobody published them) and put first in line for reuse; the
prefix hit counters, the preemption count and the speculative policy's step costs put
back. Like any traffic, it may evict older prefix-cache entries (reported as evictions, so
a worker's prefix index follows).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine, RequestOutput
from common.engine.request import KvImport, Request
from common.errors import FailedPreconditionError
from common.kv.hashing import BlockHash
from common.planner.profile import DecodeSample, PrefillSample, ProfileKey, WorkerProfile

log = logging.getLogger(__name__)

MIN_SAMPLES = 3  # a phase's fit has 3 terms
PREFILL_SHARE = 0.45  # of the budget, for both prefill phases; decode has the rest
STEADY_RATIO = 1.3  # the first point timed again at the end: further off, a warning


@dataclass(frozen=True)
class ProfileGrid:
    """The points asked for, before capping to the engine."""

    cold_prompt_tokens: tuple[int, ...]
    cached_prompts: tuple[tuple[int, int], ...]  # (cached prefix, new tokens after it)
    decode_contexts: tuple[int, ...]  # tokens of context per sequence
    decode_batches: tuple[int, ...]  # and always the engine's max_num_seqs
    warmup_steps: int
    timed_steps: int
    budget_s: float


# The default model (SmolLM2-135M Q4_1) on the 2-core development machine, 2 threads,
# shared with other work: quick measures in 7 s, full in 37-46 s (points left out when
# others load the cores), plus the engine's start.
QUICK = ProfileGrid(
    cold_prompt_tokens=(64, 256, 1024),
    cached_prompts=((512, 64), (1024, 128)),
    decode_contexts=(64, 512),
    decode_batches=(1, 8),
    warmup_steps=2,
    timed_steps=5,
    budget_s=10.0,
)
FULL = ProfileGrid(
    cold_prompt_tokens=(16, 64, 128, 256, 512, 1024, 2048, 4096),
    cached_prompts=((256, 16), (256, 256), (1024, 64), (1024, 512), (4096, 64), (4096, 512)),
    decode_contexts=(64, 256, 1024, 4096),
    decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    warmup_steps=3,
    timed_steps=8,
    budget_s=60.0,
)


def device_name(engine: Engine) -> str:
    """``cpu``, or ``cuda:`` and the device's name (what a profile is of, not which index)."""
    device = engine.runner.device
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def profile_key(engine: Engine, model: str) -> ProfileKey:
    """The key of ``engine``'s profile, served as ``model``. Threads are the engine's own
    setting, else the ones torch runs (a default of one per core counts as that many), and
    0 on a GPU, where they do not shape the speed."""
    on_gpu = engine.runner.device.type == "cuda"
    return ProfileKey(
        model=model,
        weight_format=engine.weight_identity or "",
        num_threads=0 if on_gpu else engine.config.num_threads or torch.get_num_threads(),
        device=device_name(engine),
    )


def measure_profile(
    engine: Engine,
    key: ProfileKey,
    quick: bool = True,
    *,
    grid: ProfileGrid | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> WorkerProfile:
    """Measures ``engine`` (which must be idle: FailedPreconditionError otherwise) on the
    QUICK or FULL grid, or ``grid``; see the module docstring for what and how."""
    if engine.has_unfinished() or engine.requests or engine.held:
        raise FailedPreconditionError(
            f"the engine is busy ({len(engine.requests)} requests in flight, "
            f"{len(engine.held)} prefilled and held); profile an idle engine"
        )
    chosen = grid or (QUICK if quick else FULL)
    start = clock()
    run = _ProfileRun(engine, chosen, clock, start)
    with run.restoring():
        run.warm_up()
        prefill = run.prefill_samples()
        decode = run.decode_samples()
        run.check_steady(prefill[0])
    elapsed_ms = (clock() - start) * 1000
    return WorkerProfile.from_samples(
        key,
        block_size=engine.block_size,
        num_kv_blocks=engine.runner.num_blocks,
        max_num_seqs=engine.config.max_num_seqs,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        prefill_samples=prefill,
        decode_samples=decode,
        measured_unix_ms=int(time.time() * 1000),
        measure_ms=elapsed_ms,
    )


class _ProfileRun:
    def __init__(
        self, engine: Engine, grid: ProfileGrid, clock: Callable[[], float], start: float
    ) -> None:
        self.engine = engine
        self.grid = grid
        self.clock = clock
        self.start = start
        self.S = engine.block_size
        self.run_id = uuid.uuid4().hex[:12]
        self.rng = random.Random(0)
        self.torch_rng = torch.Generator().manual_seed(0)
        self.num_requests = 0
        self.requests: list[Request] = []  # every one added, for the clean-up

    # -- leaving the engine as it was found ---------------------------------------------------

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Puts back, however the run ends, what a profile must not change."""
        engine = self.engine
        prefix_counts = (engine.kv.prefix_query_tokens, engine.kv.prefix_hit_tokens)
        num_preemptions = engine.num_preemptions
        step_cost = copy.deepcopy(engine.step_cost)
        try:
            yield
        finally:
            for req in self.requests:
                engine.abort(req.request_id)  # only those a raising step left behind
            hashes: list[BlockHash] = []
            for req in self.requests:
                req.update_block_hashes(self.S)
                hashes += req.block_hashes
            engine.kv.pool.forget(hashes)
            engine.kv.prefix_query_tokens, engine.kv.prefix_hit_tokens = prefix_counts
            if engine.num_preemptions != num_preemptions:
                log.warning("profile: %d preemptions while measuring skewed its samples",
                            engine.num_preemptions - num_preemptions)  # fmt: skip
            engine.num_preemptions = num_preemptions
            engine.step_cost = step_cost

    # -- the phases -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """First passes allocate and pick kernels: one short prefill and a few decode steps,
        untimed."""
        num_tokens = max(min(64, self.prompt_cap - 2), 1)  # and 3 output tokens
        sampling = SamplingParams(max_tokens=3, ignore_eos=True, speculative=False)
        self.add(self.random_tokens(num_tokens), sampling)
        self.run_to_end()

    def prefill_samples(self) -> list[PrefillSample]:
        points = self.prefill_points()
        samples: list[PrefillSample] = []
        deadline = self.start + self.grid.budget_s * PREFILL_SHARE
        last: tuple[int, float] | None = None  # (new tokens, wall seconds) of the last point
        for prompt_tokens, cached_tokens in points:
            new_tokens = prompt_tokens - cached_tokens
            predicted = last[1] * new_tokens / last[0] if last else 0.0
            if len(samples) >= MIN_SAMPLES and self.clock() + predicted > deadline:
                log.info("profile: %d prefill points left out (budget)", len(points) - len(samples))
                break
            began = self.clock()
            samples.append(self.time_prefill(prompt_tokens, cached_tokens))
            last = (new_tokens, self.clock() - began)
        return samples

    def decode_samples(self) -> list[DecodeSample]:
        points = self.decode_points()
        samples: list[DecodeSample] = []
        deadline = self.start + self.grid.budget_s
        last: tuple[int, float] | None = None  # (b * c, wall seconds) of the last point
        for batch_size, context_tokens in points:
            work = batch_size * context_tokens
            predicted = last[1] * work / last[0] if last else 0.0
            if len(samples) >= MIN_SAMPLES and self.clock() + predicted > deadline:
                log.info("profile: %d decode points left out (budget)", len(points) - len(samples))
                break
            began = self.clock()
            samples.append(self.time_decode(batch_size, context_tokens))
            last = (work, self.clock() - began)
        return samples

    def check_steady(self, first: PrefillSample) -> None:
        """Times the first point again: a machine whose speed changed while it was measured
        (other work on its cores) gave samples that disagree, and the log says so."""
        again = self.time_prefill(first.prompt_tokens, first.cached_tokens)
        ratio = again.ms / first.ms
        if not 1 / STEADY_RATIO <= ratio <= STEADY_RATIO:
            log.warning(
                "profile: the first prefill took %.1f ms, and %.1f ms again at the end: the "
                "machine's speed changed while measuring (other work on it?); its samples "
                "disagree, measure again on a quiet machine",
                first.ms, again.ms,
            )  # fmt: skip

    # -- points, capped to the engine -------------------------------------------------------

    @property
    def prompt_cap(self) -> int:
        """The longest prompt a request of one output token may have here."""
        engine = self.engine
        return min(engine.max_model_len - 1, engine.runner.num_blocks * self.S)

    def prefill_points(self) -> list[tuple[int, int]]:
        """(prompt tokens, cached tokens), fewest new tokens first."""
        cap = self.prompt_cap
        points = {(min(n, cap), 0) for n in self.grid.cold_prompt_tokens}
        if len(points) < MIN_SAMPLES:  # a context shorter than the grid's prompts
            points |= {(max(cap // 4, 1), 0), (max(cap // 2, 1), 0), (cap, 0)}
        if self.engine.config.enable_prefix_caching:
            for cached, new in self.grid.cached_prompts:
                new = min(new, cap - self.S)
                cached = min(cached, cap - new) // self.S * self.S
                if cached >= self.S and new >= 1:
                    points.add((cached + new, cached))
        return sorted(points, key=lambda p: (p[0] - p[1], p[1]))

    @property
    def decode_tokens(self) -> int:
        """Output tokens of a decode sample: the import step's, then one per step."""
        return 1 + self.grid.warmup_steps + self.grid.timed_steps

    def decode_points(self) -> list[tuple[int, int]]:
        """(batch size, context tokens at the import), least work first."""
        engine, S = self.engine, self.S
        # A sequence: context, one token computed with its import, then decode_tokens.
        max_context = (engine.max_model_len - 1 - self.decode_tokens) // S * S
        max_batch = min(engine.config.max_num_seqs, engine.config.max_num_batched_tokens)
        points: set[tuple[int, int]] = set()
        for context in self.grid.decode_contexts:
            context = min(context, max_context) // S * S
            if context < S:
                continue
            blocks_per_seq = -(-(context + 1 + self.decode_tokens) // S)
            fit = engine.runner.num_blocks // blocks_per_seq
            for batch in (*self.grid.decode_batches, engine.config.max_num_seqs):
                batch = min(batch, max_batch, fit)
                if batch >= 1:
                    points.add((batch, context))
        if len(points) < MIN_SAMPLES and max_context >= S:  # a small context or pool
            middle = (max_context // S + 1) // 2 * S
            points |= {(1, S), (1, middle), (1, max_context)}
        return sorted(points, key=lambda p: (p[0] * p[1], p[0]))

    # -- one sample ---------------------------------------------------------------------------

    def time_prefill(self, prompt_tokens: int, cached_tokens: int) -> PrefillSample:
        """From submission to the first token; a cached prefix is seeded first, untimed."""
        salt = self.new_salt()
        prompt = self.random_tokens(prompt_tokens)
        one = SamplingParams(max_tokens=1, ignore_eos=True, speculative=False)
        if cached_tokens:
            seed = prompt[:cached_tokens] + self.random_tokens(1)
            self.add(seed, one, salt, KvImport(cached_tokens, self.random_kv(cached_tokens)))
            self.run_to_end()
        began = self.clock()
        request_id = self.add(prompt, one, salt).request_id
        first = self.run_to_end()[request_id]
        assert first.new_token_ids, f"profile: a prompt of {prompt_tokens} tokens did not fit"
        ms = (self.clock() - began) * 1000
        return PrefillSample(prompt_tokens, first.num_cached_tokens, ms)

    def time_decode(self, batch_size: int, context_tokens: int) -> DecodeSample:
        """The median of the timed steps of ``batch_size`` sequences of imported context."""
        data = self.random_kv(context_tokens)
        sampling = SamplingParams(max_tokens=self.decode_tokens, ignore_eos=True, speculative=False)
        for _ in range(batch_size):
            prompt = self.random_tokens(context_tokens + 1)
            self.add(prompt, sampling, self.new_salt(), KvImport(context_tokens, data))
        step_ms: list[float] = []
        for _ in range(self.decode_tokens):
            began = self.clock()
            outputs = self.engine.step()
            step_ms.append((self.clock() - began) * 1000)
            assert len(outputs) == batch_size, (
                f"profile: a decode step of {batch_size} sequences gave {len(outputs)} outputs"
            )
        assert not self.engine.has_unfinished(), "profile: decode sequences outlived their steps"
        # The timed steps' middle one attends to this many tokens per sequence (the import
        # step computed token c, decode step k computes token c + k).
        context = context_tokens + 2 + self.grid.warmup_steps + self.grid.timed_steps // 2
        timed = step_ms[1 + self.grid.warmup_steps :]
        return DecodeSample(batch_size, context, statistics.median(timed))

    # -- requests -----------------------------------------------------------------------------

    def add(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        salt: str | None = None,
        kv_import: KvImport | None = None,
    ) -> Request:
        self.num_requests += 1
        request_id = f"profile-{self.run_id}-{self.num_requests}"
        req = self.engine.add_request(
            request_id, prompt, sampling, cache_salt=salt or self.new_salt(), kv_import=kv_import
        )
        self.requests.append(req)
        return req

    def run_to_end(self) -> dict[str, RequestOutput]:
        """Steps until the engine is idle again; each request's first output."""
        firsts: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                firsts.setdefault(out.request_id, out)
        return firsts

    def new_salt(self) -> str:
        return f"pdserve-profile-{self.run_id}-{self.num_requests}-{self.rng.getrandbits(32)}"

    def random_tokens(self, n: int) -> list[int]:
        vocab = self.engine.spec.vocab_size
        return [self.rng.randrange(vocab) for _ in range(n)]

    def random_kv(self, num_tokens: int) -> torch.Tensor:
        """KV for ``num_tokens`` tokens in the engine's wire layout, [n, *wire_shape]: one
        random block repeated (a view: the import's copy is the only one made)."""
        runner = self.engine.runner
        num_blocks = -(-num_tokens // self.S)
        g = self.torch_rng
        shape = runner.kv_block_shape  # [L, 2, S, Hkv, D]
        if runner.kv_scales is None:
            block = torch.randn(shape, generator=g).to(runner.kv_dtype)
        else:  # codes, then float32 scales [L, 2, Hkv], as bytes
            if runner.kv_dtype == torch.int8:
                codes = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
            else:
                codes = torch.randn(shape, generator=g).to(runner.kv_dtype)
            L, _, _, Hkv, _ = shape
            scales = torch.full((L, 2, Hkv), 1 / 64, dtype=torch.float32)
            block = torch.cat(
                [codes.view(torch.uint8).flatten(), scales.view(torch.uint8).flatten()]
            )
        assert tuple(block.shape) == tuple(runner.kv_wire_shape), (
            block.shape,
            runner.kv_wire_shape,
        )
        block = block.to(runner.device)
        return block.expand(num_blocks, *block.shape)

"""Speculative decoding inside the engine's step (common/engine/engine.py, scheduler.py,
model_runner.py): verify rows batched with plain decodes and prefills, rollback, bursts.

Two proposers drive it: the real prompt lookup (``--speculative-config`` ngram), and an
oracle that proposes the plain run's own next tokens with some of them corrupted, so that
every case of verification (all kept with the bonus, a miss at each position, a stop or
max_tokens inside a burst) happens on a tiny random model, which by itself rarely repeats.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.speculative.policy import StepCost
from common.kv.hashing import hash_prompt_blocks
from tests.factories import (
    make_tiny_checkpoint,
    next_logits,
    random_prompts,
    run_to_completion,
    tiny_engine,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": false}'
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama",
                                intermediate_size=128)  # fmt: skip


def _prompts() -> dict[str, list[int]]:
    prompts = random_prompts(384, [23, 41, 9, 64], seed=2)
    # Copies inside the prompt, for the lookup to find.
    return {f"r{i}": p + p[3:15] for i, p in enumerate(prompts)}


class _Proposer:
    """A proposer's interface (common/engine/speculative/proposer.py) over ``propose``."""

    cold = False

    def propose(self, req: Request, num_tokens: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, asks: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {req.request_id: self.propose(req, n) for req, n in asks}

    def forget(self, request_id: str) -> None:
        pass


class Oracle(_Proposer):
    """Proposes what the plain run emitted next, each guess replaced by a wrong token with
    probability ``miss``; records what it proposed."""

    def __init__(self, plain: dict[str, list[int]], prompts: dict[str, list[int]], miss: float,
                 seed: int = 0) -> None:  # fmt: skip
        self.plain, self.prompts, self.miss = plain, prompts, miss
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, req: Request, num_tokens: int) -> list[int]:
        done = req.num_output_tokens
        future = self.plain[req.request_id][done : done + num_tokens]
        guesses = [t if self.rng.random() >= self.miss else (t + 1) % 384 for t in future]
        self.proposed += len(guesses)
        return guesses


def _spec_engine(ckpt: Path, oracle: Oracle | None = None, **overrides: Any) -> Engine:
    engine = tiny_engine(ckpt, speculative_config=NGRAM, **overrides)
    if oracle is not None:
        engine.proposer = oracle  # type: ignore[assignment]
    return engine


def _checked_run(engine: Engine, prompts: dict[str, list[int]], sampling: SamplingParams
                 ) -> tuple[dict[str, list[int]], dict[str, list[Any]]]:  # fmt: skip
    """Runs to completion, checking after every step that each running request holds no
    block past its tokens, has computed all but its last, and that only verified tokens'
    blocks are cached."""
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    logprobs: dict[str, list[Any]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, sampling)
    verified: set[Any] = set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs
            assert len(out.new_token_ids) == len(out.new_logprobs)
        for req in engine.scheduler.running:  # rejected positions hold no blocks
            held = len(engine.kv.block_ids(req))
            assert held <= engine.kv.blocks_for_tokens(req.num_tokens), req.request_id
            if req.num_output_tokens:
                assert req.num_computed_tokens == req.num_tokens - 1, req.request_id
        for rid, prompt in prompts.items():
            verified.update(_hashes(engine, prompt + tokens[rid]))
        cached = set(engine.kv.pool.cached_hashes())
        assert cached <= verified, "a block of unverified tokens was published"
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    return tokens, logprobs


def _hashes(engine: Engine, token_ids: list[int]) -> list[Any]:
    return hash_prompt_blocks(token_ids, engine.block_size, None, seed=engine.config.hash_seed,
                              weights=engine.weight_identity)  # fmt: skip


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("miss", [0.0, 0.3, 1.0])
def test_output_equals_the_plain_runs_whatever_is_proposed(
    ckpt: Path, sampling: SamplingParams, miss: float
) -> None:
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, sampling)
    oracle = Oracle(plain, prompts, miss)
    engine = _spec_engine(ckpt, oracle)
    spec, _ = _checked_run(engine, prompts, sampling)
    assert spec == plain
    stats = engine.spec_stats
    assert stats.num_draft_tokens == oracle.proposed > 0
    if miss == 0.0:  # every guess kept: 4 proposals + the bonus per step
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_drafts < sum(len(t) for t in plain.values()) / 4
    if miss == 1.0:
        assert stats.num_accepted_tokens == 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_prompt_lookup_changes_nothing_but_the_step_count(ckpt: Path) -> None:
    prompts = _prompts()
    for sampling in (GREEDY, SEEDED):
        plain = run_to_completion(tiny_engine(ckpt), prompts, sampling)
        engine = _spec_engine(ckpt)
        spec, _ = _checked_run(engine, prompts, sampling)
        assert spec == plain
        assert engine.spec_stats.num_draft_tokens > 0


def test_logprobs_and_penalties_follow_each_verify_rows_own_context(ckpt: Path) -> None:
    prompts = _prompts()
    sampling = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=True, top_logprobs=3,
                              repetition_penalty=1.3, frequency_penalty=0.5)  # fmt: skip
    plain_engine = tiny_engine(ckpt)
    plain, plain_logprobs = _checked_run(plain_engine, prompts, sampling)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.2))
    spec, spec_logprobs = _checked_run(engine, prompts, sampling)
    assert spec == plain
    for rid in prompts:
        for a, b in zip(plain_logprobs[rid], spec_logprobs[rid], strict=True):
            assert a.token_id == b.token_id
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_stop_or_max_tokens_inside_a_burst_ends_the_output_there(ckpt: Path) -> None:
    prompts = _prompts()
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run_to_completion(tiny_engine(ckpt), prompts, long)
    # Stop on a token each plain output emits mid-way; and a max_tokens no burst lands on.
    for rid, out in plain.items():
        stop = out[17]
        sampling = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,))
        want = out[: out.index(stop) + 1]
        engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.0))
        got, _ = _checked_run(engine, {rid: prompts[rid]}, sampling)
        assert got[rid] == want
    for max_tokens in (1, 2, 7, 13):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.0))
        got, _ = _checked_run(engine, prompts, sampling)
        assert got == {rid: out[:max_tokens] for rid, out in plain.items()}


def test_a_request_can_turn_speculation_off(ckpt: Path) -> None:
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    oracle = Oracle(plain, prompts, miss=0.0)
    engine = _spec_engine(ckpt, oracle)
    off = SamplingParams(max_tokens=40, ignore_eos=True, speculative=False)
    got, _ = _checked_run(engine, prompts, off)
    assert got == plain
    assert oracle.proposed == 0 and engine.spec_stats.num_drafts == 0


def test_verifies_share_steps_with_prefills_and_plain_decodes(ckpt: Path) -> None:
    """Requests arrive while others speculate; some opt out: one batch holds verify rows,
    prefill chunks and single-token decodes, and every output is still the plain one."""
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3), max_num_batched_tokens=48)
    kinds: set[str] = set()
    execute = engine.runner.execute

    def watching(scheduled: list, tables: dict) -> Any:
        kinds.update("verify" if s.draft_token_ids else "decode" if s.num_new_tokens == 1
                     else "prefill" for s in scheduled)  # fmt: skip
        if {"verify", "prefill"} <= {("verify" if s.draft_token_ids else "prefill"
                                      if s.num_new_tokens > 1 else "decode") for s in scheduled}:
            kinds.add("mixed")
        return execute(scheduled, tables)

    engine.runner.execute = watching  # type: ignore[method-assign,assignment]
    order = list(prompts)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    engine.add_request(order[0], prompts[order[0]], GREEDY)
    step = 0
    while engine.has_unfinished() or len(order) > 1:
        if step in (3, 6, 9) and len(order) > 1:
            rid = order.pop(1)
            sampling = GREEDY if step != 6 else SamplingParams(
                max_tokens=40, ignore_eos=True, speculative=False)  # fmt: skip
            engine.add_request(rid, prompts[rid], sampling)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    assert tokens == plain
    assert {"verify", "decode", "mixed"} <= kinds
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_preemption_of_a_speculating_request_loses_nothing(ckpt: Path) -> None:
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    # Few blocks: requests preempt one another while they speculate.
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3), num_kv_blocks=14)
    got, _ = _checked_run(engine, prompts, GREEDY)
    assert got == plain
    assert engine.num_preemptions > 0


def test_the_quantized_path_verifies_as_it_decodes(ckpt: Path) -> None:
    """int4 weights on the C++ kernels and attention: a verify row is a decode query at its
    position (common/engine/model_runner.py) on the packed kernel a decode row takes
    (common/models/quant/linear.py), and that kernel computes each row alone, so each
    emitted token's logprob is the plain step's to the bit."""
    from kernels.cpu import available

    if not available():
        pytest.skip("the C++ CPU kernels do not build here")
    prompts = _prompts()
    quant: dict[str, Any] = dict(quantization="int4", quant_kernel="cpp", attention_backend="cpp")
    sampling = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True)
    plain, plain_logprobs = _checked_run(tiny_engine(ckpt, **quant), prompts, sampling)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3), **quant)
    got, logprobs = _checked_run(engine, prompts, sampling)
    assert got == plain
    assert engine.runner.model.fused_decoder is not None  # verify steps ran fused too
    for rid in prompts:
        assert [e.logprob for e in logprobs[rid]] == [e.logprob for e in plain_logprobs[rid]]


class _CpuLikeCost(StepCost):
    """The 2-core machine's decode step (6 ms + 2.2 ms a row), whatever the tiny model takes."""

    def __init__(self) -> None:
        super().__init__()
        for rows in (1, 2, 3, 4, 5) * 20:
            super().add(rows, 6.0 + 2.2 * rows)

    def add(self, rows: int, ms: float) -> None:
        pass


@pytest.mark.parametrize(("miss", "most", "least"), [(1.0, 0.25, 0.0), (0.0, 1.0, 0.95)])
def test_the_adaptive_policy_verifies_what_pays(
    ckpt: Path, miss: float, most: float, least: float
) -> None:
    """Guesses that always miss are soon no longer verified (a request retries now and
    then); guesses that are always kept are all verified."""
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    adaptive = NGRAM.replace(', "adaptive": false', "")
    fixed_oracle = Oracle(plain, prompts, miss)
    _checked_run(_spec_engine(ckpt, fixed_oracle), prompts, GREEDY)
    oracle = Oracle(plain, prompts, miss)
    engine = tiny_engine(ckpt, speculative_config=adaptive)
    engine.proposer = oracle  # type: ignore[assignment]
    engine.step_cost = _CpuLikeCost()
    got, _ = _checked_run(engine, prompts, GREEDY)
    assert got == plain
    assert least * fixed_oracle.proposed <= oracle.proposed <= most * fixed_oracle.proposed


def test_a_rejected_round_gives_back_exactly_the_blocks_of_its_rejected_positions(
    ckpt: Path,
) -> None:
    """Block size 16, a prompt of 14: the first decode step holds position 14 (the prompt's
    last token's row is 13; the first sampled token sits at 14) in block 0; 4 guesses reach
    positions 15..18, into a second block. All rejected: that block goes back to the pool,
    and a block is taken again once the sequence really reaches position 16."""
    (prompt,) = random_prompts(384, [14], seed=9)
    plain = run_to_completion(tiny_engine(ckpt), {"r": prompt}, GREEDY)
    oracle = Oracle(plain, {"r": prompt}, miss=1.0)
    engine = _spec_engine(ckpt, oracle, num_kv_blocks=8)
    pool = engine.kv.pool
    engine.add_request("r", prompt, GREEDY)
    (out,) = engine.step()  # the prefill: one block for 14 tokens, the first token sampled
    req = engine.requests["r"]
    first_block = engine.kv.block_ids(req)
    assert len(first_block) == 1 and pool.num_free == 7 and req.num_tokens == 15
    seen: list[int] = []
    allocate = pool.allocate

    def watching(num_blocks: int) -> list:
        blocks = allocate(num_blocks)
        seen.extend(b.block_id for b in blocks)
        return blocks

    pool.allocate = watching  # type: ignore[method-assign]
    (out,) = engine.step()  # guesses for 15..18: a second block for the verify, all rejected
    assert len(seen) == 1 and out.new_token_ids == plain["r"][1:2]
    assert engine.kv.block_ids(req) == first_block and pool.num_free == 7
    assert req.num_computed_tokens == 15 and req.num_tokens == 16
    (out,) = engine.step()  # position 16 now needs the second block for real
    assert engine.kv.block_ids(req) == first_block + seen[1:2] and pool.num_free == 6
    assert not pool.blocks[seen[0]].ref_count  # the block given back is still free
    engine.abort("r")
    assert pool.num_free == pool.num_blocks


def test_per_request_counts_add_up_to_the_engines(ckpt: Path) -> None:
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3))
    last: dict[str, tuple[int, int, int]] = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                last[out.request_id] = out.spec
    stats = engine.spec_stats
    assert sum(r for r, _, _ in last.values()) == stats.num_drafts
    assert sum(p for _, p, _ in last.values()) == stats.num_draft_tokens
    assert sum(a for _, _, a in last.values()) == stats.num_accepted_tokens


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_dtype="int8"),
        dict(max_num_batched_tokens=24),  # chunked prefill beside verifies
        dict(enable_prefix_caching=False),
    ],
    ids=["int8-kv", "chunked-prefill", "no-prefix-cache"],
)
def test_speculation_with_the_engines_other_features(ckpt: Path, overrides: dict) -> None:
    prompts = _prompts()
    # A second copy of the first prompt: a prefix-cache hit when caching is on.
    prompts["again"] = prompts["r0"][:20] + prompts["r1"][:5]
    plain = run_to_completion(tiny_engine(ckpt, **overrides), prompts, GREEDY)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3), **overrides)
    got, _ = _checked_run(engine, prompts, GREEDY)
    assert got == plain
    assert engine.spec_stats.num_accepted_tokens > 0


def test_an_moe_model_speculates_alike(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", intermediate_size=128,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                head_dim=32)  # fmt: skip
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3))
    got, _ = _checked_run(engine, prompts, GREEDY)
    assert got == plain


def test_an_aborted_speculating_request_holds_no_block(ckpt: Path) -> None:
    prompts = _prompts()
    plain = run_to_completion(tiny_engine(ckpt), prompts, GREEDY)
    engine = _spec_engine(ckpt, Oracle(plain, prompts, miss=0.3))
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    for _ in range(5):
        engine.step()
    assert engine.spec_stats.num_drafts > 0
    for rid in prompts:
        assert engine.abort(rid)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert not engine.has_unfinished()


# The statistical test on a tiny model. A request resumed after a fixed first token samples
# its second token from its prefill chunk; for the trials whose second token is the likeliest
# one, t, the third position has a known distribution p (the model's logits after prompt,
# first, t, under the request's temperature and top-k), and the proposer guesses one fixed
# token x there. Over TRIALS seeds the third tokens of those trials are counted and compared
# with p by a chi-square statistic over the top-k support: P(chi2 > 30) for 7 degrees of
# freedom is 1e-4 for an exact sampler. x is kept about p(x) of the time; a sampler that on
# rejection drew from p instead of the residual would over-produce x.
TRIALS, TOP_K, CHI2_BOUND = 3000, 8, 30.0


def test_sampled_tokens_follow_the_targets_distribution_on_a_tiny_model(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [12], seed=21)
    first = 7
    likeliest = int(next_logits(tiny_engine(ckpt), prompt, [first])[:384].argmax())
    top = torch.topk(next_logits(tiny_engine(ckpt), prompt, [first, likeliest])[:384], TOP_K)
    p = torch.softmax(top.values.double(), dim=-1)
    support = top.indices.tolist()
    x = support[1]  # the second most likely: rejected often enough to test the residual

    class Fixed(_Proposer):
        def propose(self, req: Request, num_tokens: int) -> list[int]:
            return [x] if req.output_token_ids == [first, likeliest] else []

    engine = tiny_engine(ckpt, speculative_config=NGRAM, max_num_seqs=256, num_kv_blocks=1024,
                         max_waiting=TRIALS)  # fmt: skip
    engine.proposer = Fixed()  # type: ignore[assignment]
    sampling = dict(max_tokens=4, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    for seed in range(TRIALS):
        engine.add_request(f"s{seed}", prompt, SamplingParams(seed=seed, **sampling),
                           output_token_ids=[first])  # fmt: skip
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    thirds = [o[1] for o in outputs.values() if o[0] == likeliest]
    counts = torch.tensor([thirds.count(t) for t in support], dtype=torch.float64)
    n = len(thirds)
    assert counts.sum() == n > 500 and engine.spec_stats.num_drafts == n
    kept = engine.spec_stats.num_accepted_tokens / n
    assert kept == pytest.approx(float(p[1]), abs=4 * math.sqrt(p[1] * (1 - p[1]) / n))
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    print(f"n {n}, p {[round(v, 3) for v in p.tolist()]}, kept {kept:.3f} "
          f"(p(x) {float(p[1]):.3f}), chi2 {chi2:.1f}")  # fmt: skip
    assert chi2 < CHI2_BOUND

"""Suffix decoding (common/engine/speculative/suffix.py): Arctic Inference's suffix tree as
the proposer sees it (matches, frequencies, the speculation length), the per-tenant global
trees and their bounds, and greedy output unchanged with it on."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from common.engine.request import Request
from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

pytest.importorskip("arctic_inference.suffix_decoding", reason="scripts/setup.sh builds it")

from common.engine.speculative.suffix import SuffixProposer

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=5)


def _config(**keys: object) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                        "suffix_decoding_max_spec_factor": 4, **keys})  # fmt: skip


def _request(
    rid: str, prompt: list[int], output: tuple[int, ...] | list[int] = (), salt: str | None = None
) -> Request:
    return Request(rid, prompt, GREEDY, cache_salt=salt, output_token_ids=list(output))


def _serve(proposer: SuffixProposer, rid: str, prompt: list[int], output: list[int],
           salt: str | None = None) -> None:  # fmt: skip
    """A request that ran here to its end: asked for guesses once with its whole output."""
    proposer.propose(_request(rid, prompt, output, salt), 4)
    proposer.forget(rid)


def test_guesses_continue_the_longest_match_in_the_requests_own_context() -> None:
    proposer = SuffixProposer(_config())
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 5, 6, 7]
    # 5 6 7 matched (3 tokens): up to 4 x 3 guesses, the tokens after the earlier 5 6 7.
    assert proposer.propose(_request("a", prompt), 8) == [8, 9, 10, 11, 12, 40, 41, 5]
    assert proposer.propose(_request("a", prompt), 3) == [8, 9, 10]  # at most what is asked
    # A verified token moves the context on: now 5 6 7 8 is matched.
    assert proposer.propose(_request("a", prompt, [8]), 2) == [9, 10]
    # The speculation length follows the match: factor 1 x a 1-token match = 1 guess.
    short = SuffixProposer(_config(suffix_decoding_max_spec_factor=1))
    assert short.propose(_request("b", [1, 2, 3, 9, 1]), 8) == [2]


def test_a_continuation_seen_too_rarely_is_not_guessed() -> None:
    # After 7: 8 twice, 9 once, 30 once (a quarter each for 9 and 30, a half for 8).
    prompt = [7, 8, 1, 7, 8, 2, 7, 9, 3, 7, 30, 4, 7]
    assert SuffixProposer(_config(suffix_decoding_min_token_prob=0.4)).propose(
        _request("a", prompt), 1) == [8]  # fmt: skip
    assert SuffixProposer(_config(suffix_decoding_min_token_prob=0.6)).propose(
        _request("a", prompt), 1) == []  # fmt: skip


def test_earlier_responses_of_the_tenant_are_guessed_from() -> None:
    proposer = SuffixProposer(_config())
    answer = [100, 101, 102, 103, 104, 105, 106, 107]
    _serve(proposer, "first", [1, 2, 3], answer, salt="tenant-a")
    # A new request of the same tenant whose context reaches 100 101: the rest is guessed.
    assert proposer.propose(_request("second", [9, 100, 101], salt="tenant-a"), 4) == [
        102, 103, 104, 105]  # fmt: skip
    # Only responses are shared, not prompts: the first request's prompt 1 2 3 is not.
    assert proposer.propose(_request("third", [7, 1, 2], salt="tenant-a"), 4) == []


def test_a_tenant_never_gets_guesses_from_another_tenants_responses() -> None:
    proposer = SuffixProposer(_config())
    secret = [200, 201, 202, 203, 204, 205]
    _serve(proposer, "a1", [1, 2], secret, salt="tenant-a")
    for salt in ("tenant-b", None):  # another tenant, and the unsalted shared cache
        guesses = proposer.propose(_request(f"b-{salt}", [3, 200, 201, 202], salt=salt), 8)
        assert not set(guesses) & set(secret[3:]), guesses
    assert proposer.propose(_request("a2", [3, 200, 201, 202], salt="tenant-a"), 3) == [
        203, 204, 205]  # fmt: skip
    assert proposer.stats()["tenants"] == 3


def test_responses_are_evicted_oldest_first_and_tenants_least_recently_used_first() -> None:
    proposer = SuffixProposer(_config(suffix_decoding_max_cached_requests=3))
    _serve(proposer, "r1", [1], [300, 301, 302, 303], salt="t")
    _serve(proposer, "r2", [1], [310, 311, 312, 313], salt="t")
    _serve(proposer, "r3", [1], [320, 321, 322, 323], salt="t")
    assert proposer.stats()["cached_responses"] == 3
    # A fourth request takes a slot for its own response: r1's, the oldest, goes.
    assert proposer.propose(_request("q", [9, 300, 301], salt="t"), 2) == []
    assert proposer.propose(_request("q", [9, 300, 301], [310, 311], salt="t"), 2) == [312, 313]
    assert proposer.stats()["cached_responses"] == 3
    # The token bound too: one response of 6 tokens fits a bound of 8, two do not.
    tokens = SuffixProposer(_config(), max_cached_tokens=8)
    _serve(tokens, "x1", [1], [400, 401, 402, 403, 404, 405], salt="old")
    _serve(tokens, "y1", [1], [500, 501, 502, 503, 504, 505], salt="new")
    assert tokens.stats() == {"tenants": 1, "active_requests": 0, "cached_responses": 1,
                              "cached_tokens": 6}  # fmt: skip
    assert tokens.propose(_request("x2", [400, 401], salt="old"), 3) == []
    assert tokens.propose(_request("y2", [500, 501], salt="new"), 3) == [502, 503, 504]


def test_no_global_tree_with_zero_cached_requests() -> None:
    proposer = SuffixProposer(_config(suffix_decoding_max_cached_requests=0))
    _serve(proposer, "r1", [1], [600, 601, 602, 603])
    assert proposer.propose(_request("r2", [600, 601]), 2) == []
    assert proposer.stats()["cached_responses"] == 0


def test_with_prompt_lookup_the_longer_match_wins() -> None:
    # The trees see 2 tokens back (depth 2): "3 4" was followed by 50 and by 60. Prompt
    # lookup (up to 4-grams) finds "1 2 3 4", followed by 50 9.
    prompt = [1, 2, 3, 4, 50, 9, 8, 3, 4, 60, 7, 1, 2, 3, 4]
    both = SuffixProposer(_config(suffix_decoding_max_tree_depth=2, prompt_lookup_max=4))
    assert both.ngram == (1, 4)
    assert both.propose(_request("a", prompt), 2) == [50, 9]
    # Where the trees match longer, theirs win: a 5-token repeat against 2-grams at most.
    deep = SuffixProposer(_config(prompt_lookup_max=2, prompt_lookup_min=2))
    prompt = [20, 21, 22, 23, 24, 25, 26, 9, 22, 23, 30, 20, 21, 22, 23]
    assert deep.propose(_request("b", prompt), 2) == [24, 25]  # lookup alone: 30 (latest)
    config = _config(prompt_lookup_max=3)
    assert config.suffix_with_ngram and SpeculativeConfig.from_json(config.to_json()) == config
    assert not _config().suffix_with_ngram


def test_the_config_takes_vllms_names_and_refuses_bad_values() -> None:
    # {"method": "suffix"} alone: vLLM's defaults, guesses up to the tree's depth (16 at most).
    bare = SpeculativeConfig.from_json('{"method": "suffix"}')
    assert (bare.num_speculative_tokens, bare.suffix_decoding_max_tree_depth) == (16, 24)
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 8}
                                       ).num_speculative_tokens == 8  # fmt: skip
    config = _config(suffix_decoding_max_tree_depth=32, suffix_decoding_min_token_prob=0.2)
    assert SpeculativeConfig.from_json(config.to_json()) == config
    assert config.suffix_decoding_max_spec_factor == 4.0
    with pytest.raises(SpeculativeConfigError, match="apply to method suffix only"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "suffix_decoding_max_tree_depth": 8})  # fmt: skip
    with pytest.raises(SpeculativeConfigError, match="min_token_prob must be in"):
        _config(suffix_decoding_min_token_prob=1.5)
    with pytest.raises(SpeculativeConfigError, match="max_tree_depth must be an integer"):
        _config(suffix_decoding_max_tree_depth=2.5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("suffix") / "llama", "llama",
                                intermediate_size=128)  # fmt: skip


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_output_is_the_same_with_suffix_decoding_on(ckpt: Path, sampling: SamplingParams) -> None:
    """Rounds of the same prompts: from the second on, the tenant's global tree holds the
    first round's answers and guesses are kept; the tokens are plain decoding's, greedy or
    seeded (rejection sampling keeps the target's distribution and the seed its draws)."""
    drawn = random_prompts(384, [30, 45, 12], seed=4)
    prompts = {f"r{i}": p + p[2:12] for i, p in enumerate(drawn)}
    plain = run_to_completion(tiny_engine(ckpt, num_threads=1), prompts, sampling)
    # Not adaptive: the policy's step costs are timings, and this test needs guesses.
    spec = tiny_engine(ckpt, num_threads=1, speculative_config=_config(adaptive=False).to_json())
    kept = []
    for round_ in range(2):
        got: dict[str, list[int]] = {rid: [] for rid in prompts}
        accepted = 0
        for rid, prompt in prompts.items():
            spec.add_request(f"{rid}-{round_}", prompt, sampling, cache_salt="tenant")
        while spec.has_unfinished():
            for out in spec.step():
                got[out.request_id.rsplit("-", 1)[0]] += out.new_token_ids
                if out.finished and out.spec is not None:
                    accepted += out.spec[2]
        assert got == plain, round_
        kept.append(accepted)
    print(f"{sampling.temperature}: guesses kept per round {kept}")
    assert kept[1] > kept[0], kept  # the second round guesses from the first's answers

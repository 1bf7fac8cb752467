"""Gateway routing and prefix-overlap arithmetic."""

from __future__ import annotations

import pytest

from common.errors import UnavailableError
from common.index.prefix_index import prefix_overlap
from common.index.registry import WorkerInfo
from services.gateway.routing import Router


def worker(
    worker_id: str,
    role: str,
    running: int = 0,
    waiting: int = 0,
    free: int = 100,
    pending_tokens: int = 0,
) -> WorkerInfo:
    info = WorkerInfo(worker_id, role, f"{worker_id}:1", "m", 100, free, running, waiting)
    info.num_pending_tokens = pending_tokens
    return info


def test_prefix_overlap_counts_leading_blocks_without_gaps() -> None:
    locations = [
        {"a": "cpu", "b": "cpu", "store": "memory"},
        {"a": "cpu", "store": "memory"},
        {"b": "cpu", "store": "memory"},
    ]
    assert prefix_overlap(locations) == {"a": 2, "b": 1, "store": 3}
    assert prefix_overlap([]) == {}


def test_prefill_goes_to_the_worker_holding_the_prefix() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    prefills = [worker("p0", "prefill"), worker("p1", "prefill")]
    decodes = [worker("d0", "decode")]
    for i in range(20):
        route = router.choose(f"r{i}", 400, {"p1": 10}, prefills, decodes)
        assert route.prefill is not None and route.prefill.worker_id == "p1"
        assert route.overlap_blocks == 10
        assert route.reason == "prefix_overlap"


def test_load_outweighs_a_small_overlap() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    # p1 holds 32 of the 400 tokens but has 500 queued: p0 starts sooner.
    prefills = [worker("p0", "prefill"), worker("p1", "prefill", waiting=1, pending_tokens=500)]
    route = router.choose("r", 400, {"p1": 2}, prefills, [worker("d0", "decode")])
    assert route.prefill is not None and route.prefill.worker_id == "p0"
    assert route.reason == "load"
    # With 20 tokens queued the 32 cached ones win.
    prefills[1].num_pending_tokens = 20
    route = router.choose("r", 400, {"p1": 2}, prefills, [worker("d0", "decode")])
    assert route.prefill is not None and route.prefill.worker_id == "p1"


def test_requests_sharing_a_prefix_spread_once_its_holder_is_busier_than_it_saves() -> None:
    """The score is tokens of work: a 512-token prefix held by p1 is worth 512 tokens of
    queue there, no more. Requests pile onto p1 while their queued suffixes and prompts
    cost less than recomputing the prefix on p0, then spill over."""
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    prefills = [worker("p0", "prefill"), worker("p1", "prefill")]
    decodes = [worker("d0", "decode")]
    chosen = []
    for i in range(6):
        route = router.choose(f"r{i}", 544, {"p1": 32}, prefills, decodes)
        assert route.prefill is not None
        chosen.append(route.prefill.worker_id)
        # Start the call as the servicer does: its work is what p1 would not have cached.
        cached = router.cached_tokens(544, {"p1": 32}, route.prefill)
        router.call_started(route.prefill.worker_id, 544 - cached)
    # p1 computes 32 per request; p0 544. p1 takes requests until 32 * k > 512, p0 then
    # takes one, and so on. With 6 calls in flight none has finished: p1 gets them all.
    assert chosen == ["p1"] * 6
    router.call_started("p1", 600 - 6 * 32)  # a long unrelated prompt queued on p1: 600 in all
    route = router.choose("r-next", 544, {"p1": 32}, prefills, decodes)
    assert route.prefill is not None and route.prefill.worker_id == "p0"


def test_pending_tokens_take_the_larger_of_heartbeat_and_calls_in_flight() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    w = worker("p0", "prefill", pending_tokens=300)
    assert router.pending_tokens(w) == 300
    router.call_started("p0", 500)  # sent since the last heartbeat
    assert router.pending_tokens(w) == 500
    # The last token of a fully cached prompt is computed all the same.
    assert router.cached_tokens(64, {"p0": 4}, w) == 63
    assert router.cached_tokens(100, {"p0": 4}, w) == 64


def test_ties_spread_across_workers() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    prefills = [worker("p0", "prefill"), worker("p1", "prefill")]
    chosen = {
        router.choose(f"r{i}", 400, {}, prefills, [worker("d0", "decode")]).prefill.worker_id
        for i in range(40)
    }  # type: ignore[union-attr]
    assert chosen == {"p0", "p1"}


def test_decode_picks_the_least_loaded_then_most_free() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    decodes = [
        worker("d0", "decode", running=3),
        worker("d1", "decode", running=1, free=10),
        worker("d2", "decode", running=1, free=50),
    ]
    route = router.choose("r", 400, {}, [worker("p0", "prefill")], decodes)
    assert route.decode.worker_id == "d2"
    for _ in range(5):
        router.call_started("d2")
    assert router.choose("r", 400, {}, [worker("p0", "prefill")], decodes).decode.worker_id == "d1"


def test_short_or_mostly_cached_prompts_prefill_on_the_decode_worker() -> None:
    router = Router(block_size=16, local_prefill_tokens=32, overlap_weight=1.0)
    prefills = [worker("p0", "prefill")]
    decodes = [worker("d0", "decode"), worker("d1", "decode")]
    short = router.choose("r", 20, {}, prefills, decodes)
    assert short.prefill is None and short.reason == "local_prefill_short"
    cached = router.choose("r", 400, {"d1": 24}, prefills, decodes)  # 384 of 400 tokens cached
    assert (
        cached.prefill is None and cached.decode.worker_id == "d1" and cached.overlap_blocks == 24
    )
    assert cached.reason == "local_prefill_cached"
    long = router.choose("r", 400, {"d1": 10}, prefills, decodes)
    assert long.prefill is not None and long.reason == "load"


def test_without_prefill_workers_the_decode_worker_prefills() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    route = router.choose("r", 400, {}, [], [worker("d0", "decode")])
    assert route.prefill is None and route.decode.worker_id == "d0"
    assert route.reason == "no_prefill_worker"


def test_no_decode_worker_is_unavailable_and_no_prefill_falls_back() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    with pytest.raises(UnavailableError, match="no decode worker"):
        router.choose("r", 400, {}, [worker("p0", "prefill")], [])
    assert router.choose("r", 400, {}, [], [worker("d0", "decode")]).prefill is None


def test_round_robin_takes_each_role_in_turn_blind_to_index_and_load() -> None:
    router = Router(16, 16, 1.0, policy="round-robin")
    prefills = [worker("p1", "prefill", waiting=9), worker("p0", "prefill")]
    decodes = [worker("d1", "decode", running=9), worker("d0", "decode")]
    routes = [router.choose(f"r{i}", 400, {"p1": 20}, prefills, decodes) for i in range(4)]
    assert [r.prefill.worker_id for r in routes] == ["p0", "p1", "p0", "p1"]  # type: ignore[union-attr]
    assert [r.decode.worker_id for r in routes] == ["d0", "d1", "d0", "d1"]
    assert {r.reason for r in routes} == {"round_robin"}
    assert [r.overlap_blocks for r in routes] == [0, 20, 0, 20]  # what the chosen worker holds
    short = router.choose("s", 8, {}, prefills, decodes)
    assert short.prefill is None and short.reason == "local_prefill_short"


def test_load_policy_ignores_the_prefix_index() -> None:
    router = Router(16, 16, 1.0, policy="load")
    prefills = [worker("p0", "prefill"), worker("p1", "prefill", waiting=1, pending_tokens=16)]
    route = router.choose("r", 400, {"p1": 20}, prefills, [worker("d0", "decode")])
    assert route.prefill is not None and route.prefill.worker_id == "p0"
    assert route.reason == "load"
    with pytest.raises(ValueError, match="round-robin"):
        Router(16, 16, 1.0, policy="random")


def test_a_worker_in_both_roles_prefills_what_it_decodes_and_for_others() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    both = worker("b0", "both")
    # Alone, it is the prefill and the decode worker: it prefills locally.
    route = router.choose("r", 400, {}, [both], [both])
    assert route.prefill is None and route.decode is both and route.reason == "colocated"
    # Beside a busier decode-only worker it takes the decode too.
    busy_decode = worker("d0", "decode", running=4)
    route = router.choose("r", 400, {}, [both], [both, busy_decode])
    assert (route.decode, route.prefill, route.reason) == (both, None, "colocated")
    # When the decode-only worker is the less loaded, the both worker prefills for it.
    both.num_running = 6
    route = router.choose("r", 400, {}, [both], [both, worker("d1", "decode")])
    assert route.decode.worker_id == "d1"
    assert route.prefill is both and route.reason == "load"


def test_round_robin_never_sends_a_prompt_from_a_worker_to_itself() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0, policy="round-robin")
    both = worker("b0", "both")
    routes = [router.choose(f"r{i}", 400, {}, [both], [both]) for i in range(3)]
    assert all(r.prefill is None and r.reason == "colocated" for r in routes)

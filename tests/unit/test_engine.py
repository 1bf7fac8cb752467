"""Engine behaviour on a tiny random llama: prefix cache, preemption, abort, the split, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.engine.request import FinishReason, KvImport
from common.errors import InvalidRequestError, NotFoundError, QueueFullError
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def all_free(engine: Engine) -> bool:
    pool = engine.kv.pool
    return pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


def test_prefix_hit_computes_only_uncached_tokens(ckpt: Path) -> None:
    shared, tail_a, tail_b = random_prompts(384, [70, 9, 13], seed=1)
    engine = tiny_engine(ckpt)
    first = run_to_completion(engine, {"a": shared + tail_a}, GREEDY)
    before = engine.runner.num_forward_tokens
    second = run_to_completion(engine, {"b": shared + tail_b}, GREEDY)
    computed = engine.runner.num_forward_tokens - before
    # 70 shared tokens = 4 full blocks (64 tokens) cached; the rest of the prompt is computed,
    # then one token per decode step (the last sampled token needs no forward).
    prompt_len = len(shared) + len(tail_b)
    assert computed == (prompt_len - 64) + (GREEDY.max_tokens - 1)
    assert engine.kv.prefix_hit_tokens == 64

    fresh = tiny_engine(ckpt, enable_prefix_caching=False)
    assert run_to_completion(fresh, {"b": shared + tail_b}, GREEDY) == second
    assert fresh.runner.num_forward_tokens == prompt_len + GREEDY.max_tokens - 1
    assert first  # ran
    assert all_free(engine)


def test_identical_prompt_recomputes_only_its_last_token(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [48], seed=2)  # exactly 3 blocks
    engine = tiny_engine(ckpt)
    one = run_to_completion(engine, {"a": prompt}, GREEDY)
    before = engine.runner.num_forward_tokens
    two = run_to_completion(engine, {"b": prompt}, GREEDY)
    # The last block must be recomputed to get logits: 2 blocks hit, 16 tokens computed.
    assert engine.runner.num_forward_tokens - before == 16 + GREEDY.max_tokens - 1
    assert one["a"] == two["b"]


def test_blocks_are_free_after_finish_and_abort_anywhere(ckpt: Path) -> None:
    engine = tiny_engine(ckpt, max_num_batched_tokens=32, max_num_seqs=2)
    long_a, long_b, waiting = random_prompts(384, [100, 90, 20], seed=3)
    engine.add_request("prefilling", long_a, GREEDY)
    engine.add_request("decoding", long_b[:20], GREEDY)
    engine.add_request("waiting", waiting, GREEDY)
    engine.step()  # "prefilling" is mid-chunk, "decoding" not yet admitted
    engine.step()
    engine.step()
    states = {r: engine.requests[r].status.value for r in engine.requests}
    assert states["waiting"] == "waiting"
    assert engine.abort("prefilling") and engine.abort("waiting")
    assert not engine.abort("nonexistent")
    run = [out for _ in range(3) for out in engine.step()]
    assert any(o.request_id == "decoding" for o in run)
    assert engine.abort("decoding")
    assert not engine.has_unfinished()
    assert all_free(engine)


def test_preempted_requests_finish_with_unpreempted_output(ckpt: Path) -> None:
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(384, [30, 41, 25, 37], seed=4))}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = run_to_completion(tiny_engine(ckpt), prompts, params)
    # 12 blocks cannot hold four sequences growing to ~80 tokens: some must be preempted.
    tight = tiny_engine(ckpt, num_kv_blocks=12)
    got = run_to_completion(tight, prompts, params)
    assert tight.num_preemptions > 0
    assert got == roomy
    assert all_free(tight)


def test_export_import_across_engines_continues_identically(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [45], seed=5)
    for params in (GREEDY, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)):
        whole = run_to_completion(tiny_engine(ckpt), {"r": prompt}, params)["r"]

        producer = tiny_engine(ckpt)
        producer.add_request("r", prompt, params, prefill_only=True)
        (out,) = producer.step()
        assert out.finish_reason is FinishReason.PREFILLED and out.new_token_ids == whole[:1]
        export = producer.export_kv("r")
        assert export.num_tokens == len(prompt) and len(export.block_hashes) == 2
        assert tuple(export.data.shape) == (3, 2, 2, 16, 2, 16)  # [n, L, 2, S, Hkv, D]
        assert producer.kv.pool.num_free < producer.kv.pool.num_blocks  # held until release
        assert producer.release("r") and all_free(producer)
        with pytest.raises(NotFoundError):
            producer.export_kv("r")

        consumer = tiny_engine(ckpt)
        rest = run_to_completion(
            consumer,
            {"r": prompt},
            params,
            output_token_ids=out.new_token_ids,
            kv_import=KvImport(export.num_tokens, export.data),
        )["r"]
        assert out.new_token_ids + rest == whole
        # Only the first generated token and later ones ran on the consumer.
        assert consumer.runner.num_forward_tokens == params.max_tokens - 1
        assert all_free(consumer)


def test_seeded_request_is_independent_of_its_batch(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [21], seed=6)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = run_to_completion(tiny_engine(ckpt), {"seeded": prompt}, params)["seeded"]

    busy = tiny_engine(ckpt, max_num_batched_tokens=24)
    others = {f"o{i}": p for i, p in enumerate(random_prompts(384, [50, 7, 33, 12], seed=7))}
    noisy = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    for rid, p in others.items():
        busy.add_request(rid, p, noisy)
    got = run_to_completion(busy, {"seeded": prompt}, params)["seeded"]
    assert got == alone
    different_seed = SamplingParams(
        max_tokens=16, temperature=1.0, top_k=50, seed=99, ignore_eos=True
    )
    assert run_to_completion(tiny_engine(ckpt), {"x": prompt}, different_seed)["x"] != alone


def test_waiting_queue_is_bounded(ckpt: Path) -> None:
    engine = tiny_engine(ckpt, max_waiting=2)
    engine.add_request("a", [5, 6], GREEDY)
    engine.add_request("b", [5, 6], GREEDY)
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        engine.add_request("c", [5, 6], GREEDY)
    assert set(engine.requests) == {"a", "b"}


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], GREEDY, "prompt"),
        ([5, 384], GREEDY, "token_ids"),
        ([5] * 1020, GREEDY, "sampling.max_tokens"),
        ([5] * 1024, GREEDY, "prompt"),
        ([5], SamplingParams(stop_token_ids=(999,)), "sampling.stop_token_ids"),
    ],
)
def test_bad_requests_name_the_field(
    ckpt: Path, prompt: list[int], params: SamplingParams, field: str
) -> None:
    engine = tiny_engine(ckpt)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", prompt, params)
    assert info.value.field == field
    assert not engine.requests


def test_stop_token_and_length_finish(ckpt: Path) -> None:
    engine = tiny_engine(ckpt)
    (prompt,) = random_prompts(384, [10], seed=8)
    free_run = run_to_completion(engine, {"a": prompt}, GREEDY)["a"]
    stop_at = free_run[4]
    engine.add_request("b", prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_at,)))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == free_run[: free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP


def test_cache_salts_never_share_blocks(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [70], seed=9)
    engine = tiny_engine(ckpt)
    run_to_completion(engine, {"a1": prompt}, GREEDY, cache_salt="tenant-a")
    assert engine.kv.prefix_hit_tokens == 0
    run_to_completion(engine, {"b1": prompt}, GREEDY, cache_salt="tenant-b")
    assert engine.kv.prefix_hit_tokens == 0  # another tenant's identical prompt: no hit
    run_to_completion(engine, {"n1": prompt}, GREEDY)
    assert engine.kv.prefix_hit_tokens == 0  # nor for unsalted requests
    run_to_completion(engine, {"a2": prompt}, GREEDY, cache_salt="tenant-a")
    assert engine.kv.prefix_hit_tokens == 64  # the same tenant hits its own 4 full blocks

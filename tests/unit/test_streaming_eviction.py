"""StreamingLLM eviction in the engine (common/engine/eviction.py): against transformers on
a one-layer model, where a token's K/V depend on its own id and rotation only, so the
stream's logits at every step equal a dense forward over the tokens it kept, at the
positions it gave them (sinks rotated on, the window as written, rebased past the rotary
table); a stream runs past the context in a fixed number of blocks; nothing computed after
an eviction is published, and shared sink blocks are copied, never rotated in place; a
window wide enough to keep everything is the dense engine, token for token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.eviction import KvEviction
from common.errors import InvalidRequestError
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

S = 16


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("one-layer")
    return make_tiny_checkpoint(path, num_hidden_layers=1, max_position_embeddings=160)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("two-layers")
    return make_tiny_checkpoint(path, max_position_embeddings=160)


def test_a_one_layer_stream_equals_transformers_over_what_it_kept(one_layer: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = tiny_engine(one_layer, num_kv_blocks=32)
    eviction = KvEviction(sink_tokens=S, window_tokens=3 * S)
    steps: list[dict[str, Any]] = []
    sampler = engine.sampler

    def recording(batch: torch.Tensor, requests: list[Any]) -> Any:
        req = engine.requests["s"]
        stream = req.stream
        assert stream is not None
        steps.append(dict(logits=batch[0].clone(), tokens=list(req.token_ids),
                          computed=req.num_computed_tokens, evicted=stream.num_evicted_blocks,
                          base=stream.position_base))  # fmt: skip
        return sampler(batch, requests)

    engine.sampler = recording  # type: ignore[assignment]
    (prompt,) = random_prompts(384, [20], seed=3)
    out = run_to_completion(
        engine, {"s": prompt}, SamplingParams(max_tokens=400, ignore_eos=True), eviction=eviction
    )["s"]
    assert len(out) == 400  # 420 tokens through a model of 160 positions
    assert max(step["base"] for step in steps) > 0, "the stream never rebased"

    model = AutoModelForCausalLM.from_pretrained(str(one_layer), dtype=torch.float32).eval()
    worst = 0.0
    with torch.inference_mode():
        for step in steps[::7]:
            computed, evicted, base = step["computed"], step["evicted"], step["base"]
            first_window = (1 + evicted) * S
            kept = list(range(S)) + list(range(min(first_window, computed), computed))
            at = [evicted * S + k - base for k in range(S)] + [
                p - base for p in range(min(first_window, computed), computed)
            ]
            ids = torch.tensor([[step["tokens"][p] for p in kept]])
            logits = model(ids, position_ids=torch.tensor([at])).logits[0, -1]
            worst = max(worst, (logits - step["logits"][: logits.shape[0]]).abs().max().item())
    assert worst < 2e-4, f"largest logit difference {worst}"


def test_a_stream_runs_past_the_context_in_fixed_blocks(two_layers: Path) -> None:
    engine = tiny_engine(two_layers, num_kv_blocks=64)
    eviction = KvEviction(sink_tokens=4, window_tokens=2 * S)
    (prompt,) = random_prompts(384, [40], seed=5)
    engine.add_request("s", prompt, SamplingParams(max_tokens=600, ignore_eos=True),
                       eviction=eviction)  # fmt: skip
    held: list[int] = []
    num_out = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_out += len(out.new_token_ids)
        if engine.kv.holds("s"):
            held.append(len(engine.kv.block_ids(engine.requests["s"])))
    assert num_out == 600  # far past the 160 positions, finished by max_tokens
    assert max(held) <= 1 + 2 + 1  # the sink block, the window, the block being filled
    assert engine.stats().num_kv_blocks_free == 64  # everything freed at the end
    # Never grown: after warm-up a stream holds the same few blocks at every step.
    assert set(held[100:]) <= {3, 4}


def test_nothing_after_an_eviction_is_published_and_shared_sinks_stay(two_layers: Path) -> None:
    engine = tiny_engine(two_layers, num_kv_blocks=64)
    (prompt,) = random_prompts(384, [2 * S + 3], seed=7)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    run_to_completion(engine, {"dense": prompt}, greedy)  # publishes the prompt's 2 blocks
    (sink_block,) = [b for b in engine.kv.pool.blocks if b.block_hash is not None][:1]
    before = engine.runner.export_blocks([sink_block.block_id]).clone()
    cached_before = engine.kv.pool.num_cached

    eviction = KvEviction(sink_tokens=S, window_tokens=S)
    run_to_completion(engine, {"s": prompt}, SamplingParams(max_tokens=200, ignore_eos=True),
                      eviction=eviction)  # fmt: skip
    assert engine.requests == {} and engine.stats().num_kv_blocks_free == 64
    # The stream hit the shared sink block, evicted, rotated its own copy: the cached
    # block is as it was. Of the stream's 12 more full blocks only the first, complete
    # before the first eviction (dense KV still), was cached.
    assert torch.equal(engine.runner.export_blocks([sink_block.block_id]), before)
    assert engine.kv.pool.num_cached == cached_before + 1
    dense_again = run_to_completion(engine, {"again": prompt}, greedy)["again"]
    fresh = tiny_engine(two_layers, num_kv_blocks=64)
    assert dense_again == run_to_completion(fresh, {"x": prompt}, greedy)["x"]


def test_a_window_that_keeps_everything_is_the_dense_engine(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, max_position_embeddings=512)
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(384, [5, 37, 70], seed=9))}
    greedy = SamplingParams(max_tokens=50, ignore_eos=True)
    dense = run_to_completion(tiny_engine(model), prompts, greedy)
    wide = KvEviction(sink_tokens=4, window_tokens=128)
    streamed = run_to_completion(tiny_engine(model), prompts, greedy, eviction=wide)
    assert streamed == dense


def test_bad_eviction_settings_are_refused(two_layers: Path) -> None:
    engine = tiny_engine(two_layers)
    greedy = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="less than a KV block"):
        engine.add_request("a", [5, 6], greedy, eviction=KvEviction(4, 8))
    with pytest.raises(InvalidRequestError, match="need 304 positions"):
        engine.add_request("b", [5, 6], greedy, eviction=KvEviction(16, 128))
    quantized = tiny_engine(two_layers, kv_dtype="int8")
    with pytest.raises(InvalidRequestError, match="float KV cache"):
        quantized.add_request("c", [5, 6], greedy, eviction=KvEviction(4, 32))

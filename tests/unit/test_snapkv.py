"""SnapKV prompt compression in the engine (common/engine/compression.py).

- The block scores are the observation window's attention as transformers computes it
  (eager attention, every layer and head), with the window split over prefill chunks.
- On a one-layer model a token's K/V depend on its own id and position only, so after
  compression every decode step's logits equal transformers' over the kept tokens at their
  true positions: the positions and the slots are right.
- The blocks: the first, the window's and the best scored are kept, the rest are free;
  nothing computed after compression is published; a prompt within the budget is the
  dense engine, token for token.
- Export and import: a prefill-only engine's compressed KV, imported by another engine,
  decodes the tokens the in-process compressed run decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.compression import KvCompression, block_scores, select_blocks
from common.engine.eviction import KvEviction
from common.engine.request import KvImport
from common.errors import InvalidRequestError
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

S = 16


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snap-one-layer")
    return make_tiny_checkpoint(path, num_hidden_layers=1, max_position_embeddings=512)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("snap-two-layers")
    return make_tiny_checkpoint(path, max_position_embeddings=512)


def _scores_of(engine: Any) -> list[torch.Tensor]:
    """Records every block score vector the runner computes."""
    seen: list[torch.Tensor] = []
    original = engine.runner.snap_scores

    def recording(block_ids: list[int], snap: Any) -> torch.Tensor:
        scores = original(block_ids, snap)
        seen.append(scores.clone())
        return scores

    engine.runner.snap_scores = recording
    return seen


def test_select_blocks_keeps_the_first_the_window_and_the_best() -> None:
    policy = KvCompression(budget_tokens=5 * S, window_tokens=S)
    scores = torch.tensor([0.0, 0.1, 0.9, 0.2, 0.8, 0.05, 0.3, 0.0, 0.0, 0.0])
    # 150 tokens: 10 blocks, the window [134, 150) in blocks 8 and 9.
    assert select_blocks(scores, policy, 150, S) == [0, 2, 4, 8, 9]
    # Ties go to the earlier block; a prompt within the budget keeps everything.
    assert select_blocks(torch.zeros(10), policy, 150, S) == [0, 1, 2, 8, 9]
    assert select_blocks(scores[:5], policy, 5 * S, S) is None
    # A window on a block boundary takes one block.
    assert select_blocks(scores, policy, 160, S) == [0, 2, 4, 6, 9]


def test_block_scores_are_the_windows_attention_in_transformers(two_layers: Path) -> None:
    from transformers import AutoModelForCausalLM

    policy = KvCompression(budget_tokens=6 * S, window_tokens=24)
    # Chunks of 40 tokens: the window [176, 200) spans the last two.
    engine = tiny_engine(two_layers, max_num_batched_tokens=40)
    seen = _scores_of(engine)
    (prompt,) = random_prompts(384, [200], seed=5)
    run_to_completion(engine, {"p": prompt}, SamplingParams(max_tokens=2), compression=policy)
    (ours,) = seen

    model = AutoModelForCausalLM.from_pretrained(
        str(two_layers), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        attentions = model(torch.tensor([prompt]), output_attentions=True).attentions
    window = slice(200 - 24, 200)
    per_layer = [a[0, :, window, :].sum(dim=(0, 1)) / (a.shape[1] * 24) for a in attentions]
    per_token = torch.stack(per_layer).mean(dim=0)  # [200]
    padded = torch.zeros(13 * S)
    padded[:200] = per_token
    reference = padded.view(13, S).sum(dim=1)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)
    assert abs(float(ours.sum()) - 1.0) < 1e-4  # each query's weights sum to one


def test_a_one_layer_compressed_prompt_equals_transformers_over_what_it_kept(
    one_layer: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    policy = KvCompression(budget_tokens=5 * S, window_tokens=20)
    engine = tiny_engine(one_layer, num_kv_blocks=40, max_num_batched_tokens=64)
    steps: list[dict[str, Any]] = []
    sampler = engine.sampler

    def recording(batch: torch.Tensor, requests: list[Any]) -> Any:
        req = engine.requests["c"]
        steps.append(dict(logits=batch[0].clone(), tokens=list(req.token_ids)))
        return sampler(batch, requests)

    engine.sampler = recording  # type: ignore[assignment]
    (prompt,) = random_prompts(384, [150], seed=8)
    req = engine.add_request(
        "c", prompt, SamplingParams(max_tokens=40, ignore_eos=True), compression=policy
    )
    while engine.has_unfinished():
        engine.step()
    assert req.snap is not None and req.snap.kept_blocks is not None
    kept_blocks = req.snap.kept_blocks
    assert len(kept_blocks) == 5 and kept_blocks[0] == 0 and kept_blocks[-2:] == [8, 9]
    assert len(steps) == 40

    model = AutoModelForCausalLM.from_pretrained(str(one_layer), dtype=torch.float32).eval()
    kept = [p for b in kept_blocks for p in range(b * S, min((b + 1) * S, 150))]
    worst = 0.0
    with torch.inference_mode():
        for step in steps[1:]:  # steps[0] samples from the dense prompt's last row
            at = kept + list(range(150, len(step["tokens"])))
            ids = torch.tensor([[step["tokens"][p] for p in at]])
            logits = model(ids, position_ids=torch.tensor([at])).logits[0, -1]
            worst = max(worst, (logits - step["logits"][: logits.shape[0]]).abs().max().item())
    assert worst < 2e-4, f"largest logit difference {worst}"
    # The first token is sampled from the whole prompt's logits, as the dense engine's.
    dense = run_to_completion(tiny_engine(one_layer), {"d": prompt}, SamplingParams(max_tokens=1))
    assert dense["d"] == [steps[-1]["tokens"][150]]


def test_blocks_are_freed_and_nothing_after_compression_is_published(two_layers: Path) -> None:
    policy = KvCompression(budget_tokens=6 * S, window_tokens=S)
    engine = tiny_engine(two_layers, num_kv_blocks=64)
    (prompt,) = random_prompts(384, [20 * S + 5], seed=11)  # 21 blocks
    req = engine.add_request(
        "c", prompt, SamplingParams(max_tokens=3 * S, ignore_eos=True), compression=policy
    )
    engine.step()  # the whole prompt in one chunk, then compressed
    assert req.snap is not None and req.snap.kept_blocks is not None
    assert len(req.snap.kept_blocks) == 6 and req.snap.kept_blocks[-2:] == [19, 20]
    assert len(engine.kv.block_ids(req)) == 6
    assert req.num_evicted_tokens == 15 * S
    # The prompt's full blocks were published while dense; the 15 dropped are free (and
    # still prefix hits until reused), the 6 kept are in use.
    assert engine.kv.pool.num_free == 64 - 6
    while engine.has_unfinished():
        engine.step()
    req.update_block_hashes(S)
    generated_hashes = req.block_hashes[21:]
    assert generated_hashes, "the output filled blocks"
    assert all(engine.kv.pool.cached(h) is None for h in generated_hashes)
    assert engine.kv.pool.num_free == 64
    assert (engine.num_compressed, engine.num_compressed_kept_blocks) == (1, 6)
    assert engine.num_compressed_dropped_blocks == 15


def test_a_prompt_within_the_budget_is_the_dense_engine(two_layers: Path) -> None:
    prompts = dict(zip("ab", random_prompts(384, [70, 95], seed=2), strict=True))
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    dense = run_to_completion(tiny_engine(two_layers), prompts, sampling)
    policy = KvCompression(budget_tokens=6 * S, window_tokens=S)
    engine = tiny_engine(two_layers)
    snap = run_to_completion(engine, prompts, sampling, compression=policy)
    assert snap == dense
    assert engine.num_compressed == 0


def test_compressed_kv_exported_and_imported_decodes_as_in_process(two_layers: Path) -> None:
    policy = KvCompression(budget_tokens=5 * S, window_tokens=S)
    prompts = random_prompts(384, [200, 131, 333], seed=4)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    local = tiny_engine(two_layers)
    expected = run_to_completion(
        local, {str(i): p for i, p in enumerate(prompts)}, sampling, compression=policy
    )
    producer, consumer = tiny_engine(two_layers), tiny_engine(two_layers, num_kv_blocks=32)
    for i, prompt in enumerate(prompts):
        rid = str(i)
        first = run_to_completion(
            producer, {rid: prompt}, sampling, prefill_only=True, compression=policy
        )[rid]
        export = producer.export_kv(rid)
        producer.release(rid)
        assert export.kept_blocks is not None and len(export.kept_blocks) == 5
        assert export.data.shape[0] == 5
        assert len(export.block_hashes) == len(prompt) // S  # the handle names every block
        kv = KvImport(export.num_tokens, export.data, export.kept_blocks)
        rest = run_to_completion(
            consumer, {rid: prompt}, sampling, output_token_ids=first, kv_import=kv
        )[rid]
        assert first + rest == expected[rid], f"prompt {i}"
    assert consumer.kv.pool.num_free == 32


def test_a_bad_import_or_policy_is_refused(two_layers: Path) -> None:
    engine = tiny_engine(two_layers)
    (prompt,) = random_prompts(384, [100], seed=1)  # 7 blocks
    sampling = SamplingParams(max_tokens=4)
    data = torch.zeros(3, *engine.runner.kv_wire_shape)
    for kept in ([0, 2, 5], [0, 6, 6], [3, 1, 6]):
        with pytest.raises(InvalidRequestError, match="kept_block_indices"):
            engine.add_request("x", prompt, sampling, output_token_ids=[5],
                               kv_import=KvImport(100, data, kept))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="no room past the first block"):
        engine.add_request("x", prompt, sampling, compression=KvCompression(2 * S, S))
    with pytest.raises(InvalidRequestError, match="StreamingLLM"):
        engine.add_request("x", prompt, sampling, compression=KvCompression(8 * S, S),
                           eviction=KvEviction(4, 2 * S))  # fmt: skip
    with pytest.raises(InvalidRequestError, match="window_tokens"):
        KvCompression(8 * S, 0).check(S)


def test_block_scores_by_hand() -> None:
    # Two keys per block; one query at position 3 with all weight on key 2.
    q = torch.zeros(1, 1, 2)
    q[0, 0, 0] = 50.0
    keys = torch.zeros(4, 1, 2)
    keys[2, 0, 0] = 1.0
    scores = block_scores([q], torch.tensor([3]), [keys], 2, 1.0)
    torch.testing.assert_close(scores, torch.tensor([0.0, 1.0]), atol=1e-6, rtol=0)


def test_the_window_is_computed_whole_past_a_prefix_hit_or_an_import(two_layers: Path) -> None:
    policy = KvCompression(budget_tokens=5 * S, window_tokens=24)
    engine = tiny_engine(two_layers)
    seen = _scores_of(engine)
    (prompt,) = random_prompts(384, [190], seed=9)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    cold = run_to_completion(engine, {"a": prompt}, sampling, compression=policy)["a"]
    # Again: the prompt's full blocks are prefix hits, but the window's are recomputed.
    hit = run_to_completion(engine, {"b": prompt}, sampling, compression=policy)["b"]
    # A dense import of all but the last token is cut back to before the window.
    producer = tiny_engine(two_layers)
    run_to_completion(producer, {"p": prompt}, SamplingParams(max_tokens=2), prefill_only=True)
    export = producer.export_kv("p")
    num_full = len(prompt) // S
    kv = KvImport(num_full * S, export.data[:num_full])
    imported = run_to_completion(engine, {"c": prompt}, sampling, kv_import=kv, compression=policy)
    imported = imported["c"]
    assert len(seen) == 3
    for scores in seen[1:]:
        torch.testing.assert_close(scores, seen[0], atol=1e-5, rtol=1e-4)
    assert cold == hit == imported


def test_a_preempted_compressed_request_recomputes_and_compresses_again(
    two_layers: Path,
) -> None:
    policy = KvCompression(budget_tokens=5 * S, window_tokens=S)
    (prompt,) = random_prompts(384, [170], seed=6)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = run_to_completion(tiny_engine(two_layers), {"a": prompt}, sampling,
                                 compression=policy)["a"]  # fmt: skip
    engine = tiny_engine(two_layers, num_kv_blocks=48)
    req = engine.add_request("a", prompt, sampling, compression=policy)
    out: list[int] = []
    while len(out) < 12:
        for o in engine.step():
            out += o.new_token_ids
    assert req.snap is not None and req.snap.kept_blocks is not None
    kept = list(req.snap.kept_blocks)
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req)  # its blocks are gone: prompt and output recomputed
    assert req.stream is None and not req.snap.done
    assert engine.kv.pool.num_free == 48
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    assert req.snap.kept_blocks == kept
    assert out == expected
    assert engine.num_compressed == 2

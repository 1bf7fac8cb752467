"""Resuming a request on another engine (migration): the first engine writes its full
blocks behind as they fill; a second engine imports the blocks that were written when the
stream broke, recomputes only the tail, and continues with exactly the tokens the first
engine would have produced (greedy, seeded, with penalties)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.engine.request import FullBlocks, KvImport
from common.kv.hashing import hash_prompt_blocks
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

BLOCK = 16
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def run_writing_behind(
    engine: Engine, prompt: list[int], params: SamplingParams, **kwargs: object
) -> tuple[list[int], list[FullBlocks], list[int]]:
    """(tokens, written-behind blocks per output, tokens output when each was handed over)."""
    engine.add_request("r", prompt, params, write_behind=True, **kwargs)  # type: ignore[arg-type]
    tokens: list[int] = []
    written: list[FullBlocks] = []
    at: list[int] = []
    while True:
        (out,) = engine.step()
        tokens += out.new_token_ids
        if out.full_blocks is not None:
            written.append(out.full_blocks)
            at.append(len(tokens))
        if out.finished:
            return tokens, written, at


def test_full_blocks_are_handed_over_once_each_as_they_fill(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [45], seed=11)  # 2 full blocks + 13 tokens
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = tiny_engine(ckpt)
    tokens, written, at = run_writing_behind(engine, prompt, params)
    assert len(tokens) == MAX_TOKENS
    # Computed: the prompt and every output token but the last = 84 tokens = 5 full blocks.
    context = prompt + tokens
    want = hash_prompt_blocks(context, BLOCK, None)[: (len(context) - 1) // BLOCK]
    assert [h for blocks in written for h in blocks.block_hashes] == want
    # The prompt's 2 blocks come with the first token; block 2 (tokens 32..47) once token 47
    # is computed, i.e. with output token 47 - 45 + 2 = 4; and so on every 16 tokens.
    assert [len(b.block_hashes) for b in written] == [2, 1, 1, 1]
    assert at == [1, 4, 20, 36]
    for blocks in written:
        assert tuple(blocks.data.shape) == (len(blocks.block_hashes), 2, 2, BLOCK, 2, 16)

    # A second run of the same prompt hits the prefix cache for the prompt's 2 blocks: those
    # are not written again, only what this request computes.
    tokens_again, written_again, _ = run_writing_behind(engine, prompt, params)
    assert tokens_again == tokens
    assert [h for blocks in written_again for h in blocks.block_hashes] == want[2:]


def test_without_write_behind_outputs_carry_no_blocks(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [40], seed=12)
    engine = tiny_engine(ckpt)
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished():
        assert all(out.full_blocks is None for out in engine.step())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            top_k=40,
            seed=3,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
            ignore_eos=True,
        ),
    ],
    ids=["greedy", "seeded", "seeded_with_penalties"],
)
@pytest.mark.parametrize("cut", [1, 4, 33])
def test_resumed_request_continues_exactly(ckpt: Path, params: SamplingParams, cut: int) -> None:
    """The stream breaks after ``cut`` tokens reached the client; the blocks written behind
    by then are imported elsewhere and the rest is computed there."""
    (prompt,) = random_prompts(384, [45], seed=13)
    whole, written, at = run_writing_behind(tiny_engine(ckpt), prompt, params)
    available = [b for b, n in zip(written, at, strict=True) if n <= cut]
    stored = FullBlocks.join(available)
    assert stored is not None  # the prompt's blocks come with the first token
    num_imported = len(stored.block_hashes) * BLOCK
    assert (
        stored.block_hashes
        == hash_prompt_blocks(prompt + whole[:cut], BLOCK, None)[: len(stored.block_hashes)]
    )

    resumer = tiny_engine(ckpt)
    rest = run_to_completion(
        resumer,
        {"r": prompt},
        params,
        output_token_ids=whole[:cut],
        kv_import=KvImport(num_imported, stored.data),
    )["r"]
    assert whole[:cut] + rest == whole
    # Only the tail after the imported blocks, then one token per remaining step.
    tail = len(prompt) + cut - num_imported
    assert resumer.runner.num_forward_tokens == tail + (MAX_TOKENS - cut - 1)
    assert resumer.kv.pool.num_free == resumer.kv.pool.num_blocks


def test_resume_without_any_stored_block_recomputes_everything(ckpt: Path) -> None:
    (prompt,) = random_prompts(384, [10], seed=14)  # no full block in the prompt
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    whole, _, _ = run_writing_behind(tiny_engine(ckpt), prompt, params)
    resumer = tiny_engine(ckpt)
    rest = run_to_completion(resumer, {"r": prompt}, params, output_token_ids=whole[:3])["r"]
    assert whole[:3] + rest == whole
    assert resumer.runner.num_forward_tokens == len(prompt) + 3 + (MAX_TOKENS - 3 - 1)

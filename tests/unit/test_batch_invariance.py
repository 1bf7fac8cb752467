"""On the default CPU path (weights in the x16 layout, common/models/quant/linear.py; the C++
attention, common/engine/attention/cpp_backend.py) a sequence's logits do not depend on how
the scheduler built its steps: every matmul row is computed alone, and every prompt token's
attention is a decode query at its position. So its output, to the bit, is the same whole
or chunked, alone or beside other requests' prefills and decodes, cold or after a
prefix-cache hit, and resumed from its tokens (preemption, migration) — which is what lets
speculation, whose verify rows change the chunking of the prompts beside them, keep greedy
output equal to plain decoding at any concurrency."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.models.quant import linear
from common.models.quant.load import matmul_layouts
from kernels.cpu import available
from tests.factories import make_tiny_checkpoint, random_prompts, tiny_engine

NO_X16 = "no x16 kernels (AVX-512 BW / VL / VNNI) here"
pytestmark = [
    pytest.mark.skipif(not available() or not linear.x16_available(), reason=NO_X16),
    pytest.mark.usefixtures("one_thread"),
]

STEPS = 16
SAMPLING = SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=True)
PROMPT_LEN = 150  # ten blocks of 16 and a part


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("invariance") / "llama", "llama",
                                intermediate_size=128)  # fmt: skip


def _engine(ckpt: Path, **overrides: Any) -> Engine:
    params: dict[str, Any] = dict(quantization="int4", quant_kernel="cpp",
                                  attention_backend="cpp")  # fmt: skip
    params.update(overrides)
    engine = tiny_engine(ckpt, **params)
    layouts = matmul_layouts(engine.runner.model)
    assert set(layouts) == {"x16"}, layouts
    return engine


def _run(engine: Engine, joins: dict[int, dict[str, list[int]]], watched: str = "r",
         **add: Any) -> list[float]:  # fmt: skip
    """Steps until every request finishes, adding ``joins[step]`` before that step; returns
    the logprobs of ``watched``'s tokens (their bits stand for the logits')."""
    logprobs: dict[str, list[float]] = {}
    step = 0
    while step == 0 or engine.has_unfinished():
        for rid, prompt in joins.get(step, {}).items():
            engine.add_request(rid, prompt, SAMPLING, **(add if rid == watched else {}))
            logprobs[rid] = []
        for out in engine.step():
            logprobs[out.request_id] += [e.logprob for e in out.new_logprobs]
        step += 1
    return logprobs[watched]


def test_a_sequences_logits_are_the_same_bits_however_its_steps_were_built(ckpt: Path) -> None:
    prompt, *others = random_prompts(384, [PROMPT_LEN, 90, 40, 200], seed=7)
    alone = _run(_engine(ckpt), {0: {"r": prompt}})
    assert len(alone) == STEPS
    # Chunks of 16, then 48 tokens a step, with other prompts' chunks and decodes beside.
    for budget in (16, 48):
        busy = {0: {"a": others[0]}, 1: {"r": prompt}, 3: {"b": others[1]}, 9: {"c": others[2]}}
        assert _run(_engine(ckpt, max_num_batched_tokens=budget), busy) == alone, budget
    # The second time, the prompt's full blocks are prefix-cache hits: only its tail is
    # computed, in a chunk of another length.
    engine = _engine(ckpt)
    _run(engine, {0: {"warm": prompt}}, watched="warm")
    assert engine.num_cached_prefix_tokens(prompt) == PROMPT_LEN // 16 * 16
    assert _run(engine, {0: {"r": prompt}}) == alone


def test_a_resumed_sequence_continues_with_the_same_bits(ckpt: Path) -> None:
    """A request resumed from its tokens (after a preemption, or on the worker it migrated
    to) recomputes its prompt and first outputs in one chunk: the tokens after them come out
    as the undisturbed run's, logits and all."""
    (prompt,) = random_prompts(384, [PROMPT_LEN], seed=8)
    tokens: list[int] = []
    engine = _engine(ckpt)
    engine.add_request("r", prompt, SAMPLING)
    alone: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            alone += [e.logprob for e in out.new_logprobs]
    resumed = _run(_engine(ckpt), {0: {"r": prompt}}, output_token_ids=tokens[:7])
    assert resumed == alone[7:]

"""Prompt logprobs (vLLM's ``prompt_logprobs``) on a tiny random llama: equal to
transformers' log-softmax on the same weights, the same in one chunk or many, never served
from the prefix cache or imported KV, and free for the requests that do not ask."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from common.contract.sampling import MAX_PROMPT_LOGPROBS, SamplingParams
from common.engine.config import EngineConfig
from common.engine.engine import Engine, RequestOutput
from common.engine.llm import LLM
from common.engine.request import KvImport, Request, TokenLogprob
from common.errors import InvalidRequestError
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from services.gateway.migration import continuation
from tests.factories import make_tiny_checkpoint, random_prompts, run_to_completion, tiny_engine

VOCAB = 384
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
SCORED = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.fixture(scope="module")
def hf_model(ckpt: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def hf_log_softmax(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """[P-1, V]: row i is transformers' distribution of prompt token i + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def collect(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], **add_kwargs: Any
) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, **add_kwargs)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in outputs:  # not one the caller added itself
                outputs[out.request_id].append(out)
    return outputs


def prompt_logprobs_of(outputs: list[RequestOutput]) -> list[TokenLogprob | None]:
    """The one output that carries them (the first), checked to be the only one."""
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0], "delivered once, with the first"
    result = carrying[0].prompt_logprobs
    assert result is not None
    return result


def assert_matches(entries: list[TokenLogprob | None], prompt: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        assert entry is not None and entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4)
        values, ids = torch.topk(ref[i], 3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_equal_transformers_and_leave_others_alone(
    ckpt: Path, hf_model: Any
) -> None:
    prompts = random_prompts(VOCAB, [1, 2, 37, 70], seed=11)
    plain = random_prompts(VOCAB, [23, 41], seed=12)
    engine = tiny_engine(ckpt)
    requests = {f"s{i}": (p, SCORED) for i, p in enumerate(prompts)}
    requests |= {f"p{i}": (p, GREEDY) for i, p in enumerate(plain)}
    outputs = collect(engine, requests)

    for i, prompt in enumerate(prompts):
        entries = prompt_logprobs_of(outputs[f"s{i}"])
        if len(prompt) > 1:
            assert_matches(entries, prompt, hf_log_softmax(hf_model, prompt))
        else:
            assert entries == [None]
    # The plain requests in the same batches: no prompt logprobs, the tokens of a run alone.
    alone = run_to_completion(tiny_engine(ckpt), {f"p{i}": p for i, p in enumerate(plain)}, GREEDY)
    for rid in alone:
        assert all(o.prompt_logprobs is None for o in outputs[rid])
        assert [t for o in outputs[rid] for t in o.new_token_ids] == alone[rid]


def test_steps_without_prompt_logprobs_compute_no_extra_logits(ckpt: Path) -> None:
    engine = tiny_engine(ckpt)
    calls: list[int] = []
    original = engine.runner._log_softmax

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return original(hidden)

    engine.runner._log_softmax = counting  # type: ignore[method-assign]
    prompts = random_prompts(VOCAB, [40, 33], seed=13)
    run_to_completion(engine, {"a": prompts[0], "b": prompts[1]}, GREEDY)
    assert calls == []
    run_to_completion(engine, {"c": prompts[1]}, SCORED)
    assert sum(calls) == len(prompts[1]) - 1  # one row per scored prompt token, no more


def test_chunked_prefill_equals_one_chunk(ckpt: Path) -> None:
    (prompt,) = random_prompts(VOCAB, [83], seed=14)
    results = []
    for budget in (1024, 16, 7):
        engine = tiny_engine(ckpt, max_num_batched_tokens=budget)
        outputs = collect(engine, {"r": (prompt, SCORED)}, keep_prompt_rows=True)["r"]
        rows = outputs[0].prompt_logprob_rows
        assert rows is not None and rows.shape == (len(prompt) - 1, VOCAB)
        results.append((prompt_logprobs_of(outputs), rows, outputs))
    (one, one_rows, one_out), *chunked = results
    for entries, rows, outs in chunked:
        assert torch.allclose(rows, one_rows, atol=1e-5)
        assert [e.token_id for e in entries[1:] if e] == prompt[1:]
        for a, b in zip(entries[1:], one[1:], strict=True):
            assert a is not None and b is not None
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [t for o in outs for t in o.new_token_ids] == [
            t for o in one_out for t in o.new_token_ids
        ]


def test_prefix_cache_hit_does_not_skip_positions(ckpt: Path, hf_model: Any) -> None:
    (prompt,) = random_prompts(VOCAB, [70], seed=15)  # 4 full blocks and a partial one
    engine = tiny_engine(ckpt)
    first = run_to_completion(engine, {"warm": prompt}, GREEDY)["warm"]
    num_cached_blocks = engine.kv.pool.num_cached
    assert num_cached_blocks >= 4

    before = engine.runner.num_forward_tokens
    outputs = collect(engine, {"scored": (prompt, SCORED)})["scored"]
    # Every prompt token computed (none served from the 4 cached blocks), then decode steps.
    assert engine.runner.num_forward_tokens - before == len(prompt) + SCORED.max_tokens - 1
    assert outputs[-1].num_cached_tokens == 0
    assert_matches(prompt_logprobs_of(outputs), prompt, hf_log_softmax(hf_model, prompt))
    assert [t for o in outputs for t in o.new_token_ids] == first

    # Its own (duplicate) blocks do not disturb the cache: a later plain request still hits
    # the first request's 4 blocks, and everything is free at the end.
    hits_before = engine.kv.prefix_hit_tokens
    again = run_to_completion(engine, {"again": prompt}, GREEDY)["again"]
    assert engine.kv.prefix_hit_tokens - hits_before == 64
    assert again == first
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


def test_imported_kv_is_recomputed(ckpt: Path, hf_model: Any) -> None:
    (prompt,) = random_prompts(VOCAB, [40], seed=16)
    engine = tiny_engine(ckpt)
    num_blocks = -(-len(prompt) // 16)
    spec = engine.spec
    shape = (num_blocks, spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)
    garbage = KvImport(len(prompt), torch.full(shape, 7.0))  # would give wrong logprobs
    engine.add_request("r", prompt, SCORED, output_token_ids=[5], kv_import=garbage)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert_matches(prompt_logprobs_of(outputs), prompt, hf_log_softmax(hf_model, prompt))


def test_preempted_mid_prefill_scores_every_position_once(ckpt: Path, hf_model: Any) -> None:
    long_plain, scored = random_prompts(VOCAB, [47, 64], seed=17)
    # 7 blocks of 16, steps of 16 tokens: the plain request decodes towards 107 tokens (7
    # blocks) while the newer scored one prefills 15 tokens a step; at 61 of its 64 tokens
    # no block is left and it is preempted, then computed again once the plain one is done.
    engine = tiny_engine(ckpt, num_kv_blocks=7, max_num_batched_tokens=16)
    scored_at_preemption: list[int] = []
    preempt = engine.scheduler._preempt

    def recording(req: Request) -> None:
        if req.request_id == "scored" and req.prompt_logprobs is not None:
            scored_at_preemption.append(len(req.prompt_logprobs))
        preempt(req)

    engine.scheduler._preempt = recording  # type: ignore[method-assign]
    engine.add_request("plain", long_plain, SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()  # admitted first: the older of the two
    outputs = collect(engine, {"scored": (scored, SCORED)})
    # Preempted with part of its prompt scored (it may be re-admitted and preempted again).
    assert any(1 < n < len(scored) for n in scored_at_preemption), scored_at_preemption
    assert_matches(prompt_logprobs_of(outputs["scored"]), scored, hf_log_softmax(hf_model, scored))
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


class NoTokenizer:
    """The tiny checkpoint has no tokenizer; token windows need none."""


def test_llm_score_is_the_full_distribution(ckpt: Path, hf_model: Any) -> None:
    config = EngineConfig(
        model=str(ckpt), num_kv_blocks=64, device="cpu", dtype="float32", max_num_batched_tokens=32
    )
    llm = LLM(config, tokenizer=cast(Tokenizer, NoTokenizer()))  # scoring needs none
    (window,) = random_prompts(VOCAB, [90], seed=18)
    rows = llm.score(window)
    assert rows.shape == (89, VOCAB) and rows.dtype == torch.float32
    assert torch.allclose(rows, hf_log_softmax(hf_model, window), atol=1e-4)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
    with pytest.raises(ValueError):
        llm.score(window[:1])


@pytest.mark.parametrize("value", [-1, MAX_PROMPT_LOGPROBS + 1])
def test_out_of_range_values_name_the_field(value: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.field == "sampling.prompt_logprobs"


@pytest.mark.parametrize("value", [None, 0, 5, MAX_PROMPT_LOGPROBS])
def test_proto_round_trip_keeps_unset_apart_from_zero(value: int | None) -> None:
    pb = SamplingParams(prompt_logprobs=value).to_pb(common_pb2.SamplingParams())
    assert pb.HasField("prompt_logprobs") == (value is not None)
    assert SamplingParams.from_pb(pb, 16).prompt_logprobs == value
    pb.prompt_logprobs = MAX_PROMPT_LOGPROBS + 1
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_pb(pb, 16)


def test_a_migrated_request_asks_again_only_before_its_first_token() -> None:
    from pdserve.decode.v1 import decode_pb2

    request = decode_pb2.DecodeRequest(request_id="r", prompt_token_ids=[3, 4, 5])
    SCORED.to_pb(request.sampling)
    assert continuation(request, []).sampling.prompt_logprobs == 3
    assert not continuation(request, [9]).sampling.HasField("prompt_logprobs")

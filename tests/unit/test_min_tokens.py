"""min_tokens (vLLM's): no end-of-sequence or stop token, and no stop string, before the
min_tokens-th output token. The sampler on hand-made logits, the detokenizer, the contract,
and the engine against transformers' ``min_new_tokens`` on a tiny random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.request import Request
from common.engine.sampler import Sampler
from common.errors import InvalidRequestError
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from tests.factories import make_tiny_checkpoint, random_prompts, tiny_engine

EOS = 3
LOGITS = torch.tensor([[0.0, 1.0, 0.5, 9.0, 2.0, -1.0]])  # EOS is the argmax


def pick(params: SamplingParams, num_output: int, eos: tuple[int, ...] = (EOS,)) -> int:
    request = Request("r", [0], params, eos_token_ids=eos, output_token_ids=[1] * num_output)
    return Sampler(6)(LOGITS, [request]).token_ids[0]


def test_the_sampler_masks_stop_ids_until_min_tokens() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=2)
    assert pick(params, 0) == 4 and pick(params, 1) == 4  # EOS masked: the next best
    assert pick(params, 2) == EOS  # the third token may end it
    assert pick(SamplingParams(max_tokens=8), 0) == EOS
    # Stop token ids too, and sampled draws never land on a masked id.
    with_stop = SamplingParams(max_tokens=8, min_tokens=1, stop_token_ids=(4,), ignore_eos=True)
    assert pick(with_stop, 0) == EOS  # ignore_eos: EOS is an ordinary token
    both = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(4,))
    assert pick(both, 0) == 1
    for seed in range(50):
        drawn = pick(SamplingParams(max_tokens=8, min_tokens=1, temperature=2.0, seed=seed), 0)
        assert drawn != EOS


def test_masked_ids_have_no_probability_in_logprobs() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=1, logprobs=True, top_logprobs=3)
    request = Request("r", [0], params, eos_token_ids=(EOS,))
    entry = Sampler(6)(LOGITS, [request]).logprobs[0]
    assert entry is not None and entry.token_id == 4
    assert EOS not in [t for t, _ in entry.top]


def test_the_contract_bounds_and_carries_min_tokens() -> None:
    with pytest.raises(InvalidRequestError, match=r"sampling\.min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    pb = SamplingParams(max_tokens=9, min_tokens=4).to_pb(common_pb2.SamplingParams())
    assert pb.min_tokens == 4
    assert SamplingParams.from_pb(pb, 100).min_tokens == 4
    # max_tokens 0 = the rest of the context: min_tokens is bounded by that.
    assert SamplingParams.from_pb(common_pb2.SamplingParams(min_tokens=7), 50).min_tokens == 7


def test_stop_strings_count_from_the_min_tokens_th_token(smollm_dir: Path) -> None:
    tokenizer = Tokenizer(smollm_dir)
    ids = tokenizer.encode_raw(" one two one two one two")

    def text(min_tokens: int) -> tuple[str, str | None]:
        detok = IncrementalDetokenizer(tokenizer, [], ("two",), min_tokens=min_tokens)
        out = "".join(detok.add([t]) for t in ids) + detok.flush()
        return out, detok.stop_string

    assert text(0) == (" one ", "two")
    # The first "two" ends at token 2: with min_tokens 3 it is output, the second stops.
    early, stop = text(3)
    assert stop == "two" and early == " one two one "


def test_greedy_with_min_tokens_matches_transformers_min_new_tokens(tmp_path: Path) -> None:
    """The tiny model's second greedy token made its end-of-sequence token: without
    min_tokens generation stops there; with it, it goes on exactly as transformers'
    MinNewTokensLengthLogitsProcessor makes it."""
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama")
    prompt = random_prompts(384, [9])[0]
    engine = tiny_engine(ckpt)
    engine.add_request("probe", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    probe: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            probe += out.new_token_ids
    stop = probe[1]
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    for min_tokens in (0, 5):
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12, min_new_tokens=min_tokens, do_sample=False, eos_token_id=stop,
                pad_token_id=0,
            )[0, len(prompt):].tolist()  # fmt: skip
        params = SamplingParams(max_tokens=12, min_tokens=min_tokens, stop_token_ids=(stop,),
                                ignore_eos=True)  # fmt: skip
        engine.add_request(f"m{min_tokens}", prompt, params)
        got: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                got += out.new_token_ids
        assert got == hf, (min_tokens, got, hf)
        assert len(got) == (2 if min_tokens == 0 else len(hf)) and len(got) > min_tokens
        if min_tokens:
            assert stop not in got[:min_tokens]

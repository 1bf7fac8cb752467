"""GenerateResponse messages -> OpenAI's bodies: usage across copies, the logprobs shapes."""

from __future__ import annotations

from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.openai import responses
from services.gateway.openai.responses import Choice, TokenText


class _Letters:
    """A stand-in tokenizer: token i is the letter chr(97 + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


TEXT = TokenText(_Letters())  # type: ignore[arg-type]


def entry(token: int, logprob: float, *alternatives: tuple[int, float]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token, logprob=logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in alternatives],
    )  # fmt: skip


def finished(choice: Choice, prompt: int, completion: int, cached: int) -> Choice:
    choice.add(gateway_pb2.GenerateResponse(
        text="x", token_ids=[1], finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion,
                               cached_tokens=cached),
    ))  # fmt: skip
    return choice


def test_usage_counts_each_prompt_once_and_every_choices_tokens() -> None:
    # Two prompts x two copies: the second copies found the first copies' blocks cached.
    choices = [
        finished(Choice(0, 0), 10, 4, 0), finished(Choice(1, 1), 10, 4, 8),
        finished(Choice(2, 0), 20, 5, 16), finished(Choice(3, 1), 20, 5, 16),
    ]  # fmt: skip
    assert responses.usage_body(choices) == {
        "prompt_tokens": 30, "completion_tokens": 18, "total_tokens": 48,
        "prompt_tokens_details": {"cached_tokens": 16},
    }  # fmt: skip
    assert choices[0].finish_reason == "length"


def test_completion_logprobs_offsets_and_echoed_prompt() -> None:
    got = responses.completion_logprobs(
        [entry(1, -0.5, (1, -0.5), (2, -1.5)), entry(3, float("-inf"))], TEXT, 10, 0
    )
    assert got["tokens"] == ["a", "b", "d"]
    assert got["token_logprobs"] == [None, -0.5, -9999.0]  # JSON has no -inf
    assert got["top_logprobs"] == [None, {"b": -0.5, "c": -1.5}, {}]
    assert got["text_offset"] == [10, 11, 12]


def test_chat_logprobs_carry_bytes_and_alternatives() -> None:
    got = responses.chat_logprobs([entry(2, -0.25, (2, -0.25), (4, -2.0))], TEXT)
    assert got == {"content": [{
        "token": "c", "logprob": -0.25, "bytes": [99],
        "top_logprobs": [{"token": "c", "logprob": -0.25, "bytes": [99]},
                         {"token": "e", "logprob": -2.0, "bytes": [101]}],
    }]}  # fmt: skip


def test_an_echoed_completion_starts_with_its_prompt(smollm_dir) -> None:  # type: ignore[no-untyped-def]
    tokenizer = Tokenizer(smollm_dir)
    text = TokenText(tokenizer)
    prompt_ids = tokenizer.encode_raw("Hello world")
    choice = Choice(0, 0)
    choice.add(gateway_pb2.GenerateResponse(
        text=" again", token_ids=[5], logprobs=[entry(5, -1.0)],
        prompt_logprobs=[entry(t, -2.0) for t in prompt_ids[1:]],
    ))  # fmt: skip
    body = responses.completion_choice(choice, text, True, ("Hello world", prompt_ids))
    assert body["text"] == "Hello world again"
    logprobs = body["logprobs"]
    assert logprobs["token_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(prompt_ids) + 1
    assert logprobs["text_offset"][len(prompt_ids)] == len("Hello world")

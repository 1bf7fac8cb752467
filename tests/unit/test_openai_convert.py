"""OpenAI request bodies onto the gateway's GenerateRequest (services/gateway/openai/), and
the gateway's errors onto OpenAI's error shape and HTTP status."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.contract.sampling import SamplingParams
from common.errors import (
    DrainingError,
    InvalidRequestError,
    NotFoundError,
    QueueFullError,
    UnauthenticatedError,
)
from services.gateway.openai.convert import chat_requests, completion_requests, from_exception
from services.gateway.openai.models import ChatCompletionRequest, CompletionRequest


def sampling(message: object) -> SamplingParams:
    """What the gateway's own validation makes of a converted request."""
    pb = message.sampling  # type: ignore[attr-defined]
    SamplingParams.check_pb_sizes(pb)
    return SamplingParams.from_pb(pb, default_max_tokens=100)


def test_a_text_prompt_is_raw_text_n_times_with_seeds_that_differ() -> None:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "Once upon", "n": 2, "seed": 7, "user": "ignored"}
    )
    requests = completion_requests(body, "cmpl-1")
    assert [r.request_id for r in requests] == ["cmpl-1-0", "cmpl-1-1"]
    assert all(
        r.WhichOneof("input") == "raw_prompt" and r.raw_prompt == "Once upon" for r in requests
    )
    first, second = (sampling(r) for r in requests)
    assert (first.seed, second.seed) == (7, 8)
    # OpenAI's defaults: 16 tokens for completions, temperature 1, top_p 1.
    assert first.max_tokens == 16 and first.temperature == 1.0 and first.top_p == 1.0
    assert not first.logprobs and first.prompt_logprobs is None


def test_token_id_prompts_and_a_batch_of_them() -> None:
    one = completion_requests(CompletionRequest(prompt=[5, 6, 7], max_tokens=4), "c")
    assert len(one) == 1 and list(one[0].token_ids.ids) == [5, 6, 7]
    batch = completion_requests(CompletionRequest(prompt=[[1, 2], [3]], n=2), "c")
    assert [list(r.token_ids.ids) for r in batch] == [[1, 2], [1, 2], [3], [3]]
    assert [r.request_id for r in batch] == ["c-0", "c-1", "c-2", "c-3"]
    with pytest.raises(InvalidRequestError, match=r"prompt: is empty"):
        completion_requests(CompletionRequest(prompt=[]), "c")
    with pytest.raises(InvalidRequestError, match=r"prompt\[1\]: is empty"):
        completion_requests(CompletionRequest(prompt=[[1], []]), "c")


def test_logprobs_and_echo_ask_for_token_and_prompt_logprobs() -> None:
    (message,) = completion_requests(CompletionRequest(prompt="x", logprobs=3, echo=True), "c")
    params = sampling(message)
    assert params.logprobs and params.top_logprobs == 3 and params.prompt_logprobs == 3
    (message,) = completion_requests(CompletionRequest(prompt="x", logprobs=0), "c")
    params = sampling(message)
    assert params.logprobs and params.top_logprobs == 0 and params.prompt_logprobs is None


def test_max_tokens_zero_is_the_prompt_alone_with_echo_else_a_400() -> None:
    # vLLM: echo with max_tokens 0 returns the prompt (and its logprobs) and generates
    # nothing; without echo there is nothing to return.
    (message,) = completion_requests(
        CompletionRequest(prompt="x", max_tokens=0, echo=True, logprobs=2), "c")  # fmt: skip
    params = sampling(message)
    assert params.max_tokens == 1 and params.prompt_logprobs == 2  # the token is dropped
    with pytest.raises(InvalidRequestError, match="echo") as refused:
        completion_requests(CompletionRequest(prompt="x", max_tokens=0), "c")
    assert refused.value.field == "max_tokens"
    assert from_exception(refused.value)[0] == 400
    # None (JSON null) still means what is left of the context; 1 is 1.
    (message,) = completion_requests(CompletionRequest(prompt="x", max_tokens=None), "c")
    assert message.sampling.max_tokens == 0
    (message,) = completion_requests(CompletionRequest(prompt="x", max_tokens=1), "c")
    assert message.sampling.max_tokens == 1


def test_vllm_extras_map_onto_the_sampling_parameters() -> None:
    body = CompletionRequest(
        prompt="x", temperature=0.0, top_k=-1, min_p=0.1, repetition_penalty=1.2,
        ignore_eos=True, stop=["\n\n", "END"], stop_token_ids=[2], min_tokens=3,
        cache_salt="s1",
    )  # fmt: skip
    (request,) = completion_requests(body, "c")
    assert request.cache_salt == "s1"
    params = sampling(request)
    assert params.min_tokens == 3
    assert params.greedy and params.top_k == 0 and params.min_p == pytest.approx(0.1)
    assert params.repetition_penalty == pytest.approx(1.2) and params.ignore_eos
    assert params.stop == ("\n\n", "END") and params.stop_token_ids == (2,)
    assert sampling(completion_requests(CompletionRequest(prompt="x", stop="."), "c")[0]).stop == (
        ".",
    )


def test_chat_messages_go_through_the_template_with_their_text_parts_joined() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 8,
            "logprobs": True,
            "top_logprobs": 2,
            "n": 3,
        }
    )
    requests = chat_requests(body, "chat-9")
    assert [r.request_id for r in requests] == ["chat-9-0", "chat-9-1", "chat-9-2"]
    turns = [(m.role, m.content) for m in requests[0].messages.messages]
    assert turns == [("system", "Be brief."), ("user", "Hi there")]
    params = sampling(requests[0])
    assert params.max_tokens == 8 and params.logprobs and params.top_logprobs == 2
    # No max_tokens at all: what is left of the context (the gateway's default).
    unbounded = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])  # type: ignore[list-item]
    assert sampling(chat_requests(unbounded, "c")[0]).max_tokens == 100


def test_chat_field_conflicts_are_invalid_arguments() -> None:
    user = [{"role": "user", "content": "x"}]
    both = ChatCompletionRequest(messages=user, max_tokens=4, max_completion_tokens=5)  # type: ignore[arg-type]
    with pytest.raises(
        InvalidRequestError, match="max_completion_tokens: 5 differs from max_tokens 4"
    ):
        chat_requests(both, "c")
    same = ChatCompletionRequest(messages=user, max_tokens=4, max_completion_tokens=4)  # type: ignore[arg-type]
    assert sampling(chat_requests(same, "c")[0]).max_tokens == 4
    alternatives = ChatCompletionRequest(messages=user, top_logprobs=2)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="top_logprobs: needs logprobs: true"):
        chat_requests(alternatives, "c")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": 3.0}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({}, "prompt"),
    ],
)
def test_out_of_range_fields_are_400_with_the_field_named(body: dict, param: str) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(body)
    status, error = from_exception(caught.value)
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param and param in error["error"]["message"]


def test_gateway_errors_keep_their_meaning_over_http() -> None:
    cases = [
        (InvalidRequestError("sampling.max_tokens", "too many"), 400, "invalid_request_error"),
        (UnauthenticatedError("no key"), 401, "authentication_error"),
        (NotFoundError("no model 'x'"), 404, "not_found_error"),
        (QueueFullError("the gateway is full"), 429, "rate_limit_error"),
        (DrainingError("draining"), 503, "service_unavailable_error"),
        (RuntimeError("boom"), 500, "server_error"),
    ]
    for exc, status, kind in cases:
        got_status, body = from_exception(exc)
        assert (got_status, body["error"]["type"]) == (status, kind), exc
        assert body["error"]["message"]
    _, body = from_exception(InvalidRequestError("sampling.max_tokens", "too many"))
    assert body["error"]["param"] == "sampling.max_tokens"


def constraint_of(message: object) -> object:
    return sampling(message).structured_output


def test_response_format_and_vllm_extras_become_the_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = ChatCompletionRequest.model_validate({**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    (request,) = chat_requests(body, "c")
    got = constraint_of(request)
    assert got is not None and got.kind.value == "json_schema"  # type: ignore[attr-defined]
    assert json.loads(got.text) == schema  # type: ignore[attr-defined]
    body = ChatCompletionRequest.model_validate({**chat, "response_format": {"type": "json_object"}})
    assert constraint_of(chat_requests(body, "c")[0]).kind.value == "json_object"  # type: ignore[attr-defined]
    body = ChatCompletionRequest.model_validate({**chat, "response_format": {"type": "text"}})
    assert constraint_of(chat_requests(body, "c")[0]) is None
    for extra, kind, text in (
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["a.b", "c"]}, "regex", r"(a\.b|c)"),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, "json_schema",
         '{"type": "string"}'),
    ):  # fmt: skip
        body = CompletionRequest.model_validate({"model": "m", "prompt": "p", **extra})
        got = constraint_of(completion_requests(body, "c")[0])
        assert (got.kind.value, got.text) == (kind, text), extra  # type: ignore[attr-defined]
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "guided_regex": "a", "response_format": {"type": "json_object"}}
    )
    with pytest.raises(InvalidRequestError, match="at most one constraint") as refused:
        completion_requests(body, "c")
    assert refused.value.field == "guided_regex"


def test_a_forced_tool_call_constrains_to_its_arguments() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    other = {"type": "function", "function": {"name": "g"}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool, other]}
    named = ChatCompletionRequest.model_validate(
        {**chat, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    got = constraint_of(chat_requests(named, "c")[0])
    assert json.loads(got.text) == tool["function"]["parameters"]  # type: ignore[attr-defined,index]
    required = ChatCompletionRequest.model_validate({**chat, "tool_choice": "required"})
    schema = json.loads(constraint_of(chat_requests(required, "c")[0]).text)  # type: ignore[attr-defined]
    assert [v["properties"]["name"]["const"] for v in schema["anyOf"]] == ["f", "g"]
    for choice in ("auto", "none"):  # the model answers in text
        body = ChatCompletionRequest.model_validate({**chat, "tool_choice": choice})
        assert constraint_of(chat_requests(body, "c")[0]) is None
    unknown = ChatCompletionRequest.model_validate(
        {**chat, "tool_choice": {"type": "function", "function": {"name": "h"}}})
    with pytest.raises(InvalidRequestError) as refused:
        chat_requests(unknown, "c")
    assert refused.value.field == "tool_choice.function.name"


def test_tool_calls_read_back_from_the_output() -> None:
    from services.gateway.openai.structured import ToolMode

    (call,) = ToolMode("f").tool_calls('{"x": 3}') or []
    assert call["function"] == {"name": "f", "arguments": '{"x": 3}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    (call,) = ToolMode(None).tool_calls('{"name": "g", "arguments": {}}') or []
    assert call["function"] == {"name": "g", "arguments": "{}"}
    assert ToolMode("f").tool_calls('{"x": ') is None  # cut short at max_tokens

"""Structured output through the stack (SmolLM2, 2 prefill + 2 decode workers): the OpenAI
SDK's ``response_format`` and forced tool calls, vLLM's ``guided_*`` extras, and the gRPC
API's ``StructuredOutput``. The prefill worker samples the first token under the mask and
the decode worker rebuilds the matcher from it, so every output below crossed that hop."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from common.contract.sampling import SamplingParams
from common.contract.structured import ConstraintKind, StructuredOutput
from common.telemetry.metrics import scrape
from pdserve.client import GatewayClient
from tests.integration.conftest import Stack

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]},
                      "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url(), api_key="unused", max_retries=0)


def test_response_format_json_schema_returns_content_that_validates(stack: Stack) -> None:
    sdk = client(stack)
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model=stack.model_dir.name,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            temperature=1.0, seed=seed, max_tokens=120,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_mode_streams_an_object(stack: Stack) -> None:
    stream = client(stack).chat.completions.create(
        model=stack.model_dir.name,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=200, stream=True,
        temperature=0.0,
    )  # fmt: skip
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(parts)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # max_tokens inside the object: what came is an object's beginning
        assert finish == "length" and text.lstrip().startswith("{")


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_returns_arguments_that_validate(stack: Stack, choice: str) -> None:
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}} if choice == "named"
        else "required"
    )  # fmt: skip
    reply = client(stack).chat.completions.create(
        model=stack.model_dir.name,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80, temperature=0.0,
    )  # fmt: skip
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    tools = {"get_weather": WEATHER, "get_time": TIME}
    if choice == "named":
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        tools[call.function.name]["function"]["parameters"])  # fmt: skip


def test_vllm_guided_extras_on_completions(stack: Stack) -> None:
    sdk = client(stack)
    model = stack.model_dir.name
    regex = r"[0-9]{3}-[0-9]{4}"
    for seed in range(3):
        reply = sdk.completions.create(
            model=model, prompt="A phone number:", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"guided_regex": regex},
        )  # fmt: skip
        assert re.fullmatch(regex, reply.choices[0].text), reply.choices[0].text
    reply = sdk.completions.create(
        model=model, prompt="The best color is", max_tokens=10, temperature=1.0, seed=1,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )  # fmt: skip
    assert reply.choices[0].text in ("red", "green", "blue")
    with pytest.raises(openai.BadRequestError, match="at most one constraint"):
        sdk.completions.create(model=model, prompt="x", max_tokens=4, extra_body={
            "guided_regex": "a+", "guided_json": {"type": "object"}})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=r"structured_output\.regex"):
        sdk.completions.create(model=model, prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "[a-"})  # fmt: skip


def test_grpc_constraints_hold_with_an_unconstrained_request_beside_them(stack: Stack) -> None:
    regex = r"(yes|no), because [a-z ]{4,40}\."
    constraint = StructuredOutput(ConstraintKind.REGEX, regex)

    async def run() -> list[tuple[str, str | None]]:
        gateway = GatewayClient(stack.target)
        try:
            plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            tight = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                    structured_output=constraint) for seed in range(4)]  # fmt: skip
            results = await asyncio.gather(
                gateway.complete(raw_prompt="Is the sky blue?", sampling=plain),
                *[gateway.complete(raw_prompt="Is the sky blue?", sampling=s) for s in tight],
            )
        finally:
            await gateway.close()
        return [(r.text, r.finish_reason) for r in results]

    (plain_text, plain_finish), *constrained = asyncio.run(run())
    assert plain_finish == "length" and not re.fullmatch(regex, plain_text)
    for text, finish in constrained:
        if finish == "stop":
            assert re.fullmatch(regex, text), text
        else:
            assert finish == "length", (text, finish)
    assert any(finish == "stop" for _, finish in constrained)


def test_constrained_requests_show_in_the_metrics(stack: Stack) -> None:
    """Run last in this module: the requests above were constrained."""
    children = stack.children()
    gateway = children["gateway"].metrics_url
    assert gateway is not None
    samples = scrape(gateway)
    assert samples.sum("pdserve:structured_output_requests_total") > 0
    assert samples.sum("pdserve:structured_output_check_seconds_count") > 0
    workers = [c for c in children.values() if c.role in ("prefill", "decode")]
    figures = [scrape(c.metrics_url) for c in workers if c.metrics_url]
    assert sum(f.sum("pdserve:structured_output_mask_steps_total") for f in figures) > 0
    assert sum(f.sum("pdserve:structured_output_grammars_compiled_total") for f in figures) > 0
    # Each worker compiled each grammar once at most: the rest came from its cache.
    assert sum(f.sum("pdserve:structured_output_grammar_cache_hits_total") for f in figures) > 0

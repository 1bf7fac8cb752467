"""The gateway's GenerateResponse messages -> OpenAI's response bodies and stream chunks.

A ``Choice`` gathers one GenerateRequest's messages; ``response_body`` turns the finished
choices into one response, ``completion_chunk`` and ``chat_chunk`` turn one
message into one server-sent event's JSON. Token strings (for logprobs) come from
``TokenText``, which decodes each id once."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.openai.structured import ToolMode
from services.gateway.relay import finish_reason_name


class TokenText:
    """Each token id's text on its own (special tokens included), as logprobs show it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text


@dataclass
class Choice:
    """One GenerateRequest's messages, gathered. ``prompt`` (echo only): the prompt's text
    and token ids, for a completion that repeats its prompt."""

    index: int
    copy: int  # which of the prompt's n copies: usage counts a prompt's tokens once
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: common_pb2.Usage | None = None
    num_chars: int = 0  # of text so far: where the next token's text_offset starts

    def add(self, message: gateway_pb2.GenerateResponse) -> None:
        self.text.append(message.text)
        self.num_chars += len(message.text)
        self.token_ids.extend(message.token_ids)
        self.logprobs.extend(message.logprobs)
        self.prompt_logprobs.extend(message.prompt_logprobs)
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = finish_reason_name(message.finish_reason)
        if message.HasField("usage"):
            self.usage = message.usage


def usage_body(choices: Iterable[Choice]) -> dict[str, Any]:
    """Prompt tokens once per prompt (its first copy's), completion tokens of every choice;
    cached tokens are the prompts' first copies' (the other copies reuse what they
    computed, and count in the gateway's prefix-cache metrics)."""
    prompt = completion = cached = 0
    for choice in choices:
        usage = choice.usage or common_pb2.Usage()
        completion += usage.completion_tokens
        if choice.copy == 0:
            prompt += usage.prompt_tokens
            cached += usage.cached_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _logprob(value: float) -> float:
    return max(value, -9999.0) if math.isfinite(value) else -9999.0  # JSON has no -inf


# -- completions --------------------------------------------------------------------------


def completion_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], token_text: TokenText, offset: int = 0,
    first_prompt_token: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The legacy completions shape: parallel lists of tokens, their logprobs, their best
    alternatives (text -> logprob) and each token's offset in the text. ``first_prompt_token``
    (echo): the prompt's first token, which has no logprob (null) and no alternatives."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    if first_prompt_token is not None:
        text = token_text(first_prompt_token)
        tokens.append(text)
        token_logprobs.append(None)
        top.append(None)
        text_offset.append(offset)
        offset += len(text)
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(entry.logprob))
        alternatives: dict[str, float] = {}
        for alt in entry.top_logprobs:
            alternatives.setdefault(token_text(alt.token_id), _logprob(alt.logprob))
        top.append(alternatives)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def completion_choice(
    choice: Choice, token_text: TokenText, want_logprobs: bool,
    echo: tuple[str, list[int]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    text = "".join(choice.text)
    logprobs = None
    if echo is not None:
        prompt_text, prompt_ids = echo
        if want_logprobs:
            head = completion_logprobs(
                choice.prompt_logprobs, token_text, 0, prompt_ids[0] if prompt_ids else None
            )
            tail = completion_logprobs(choice.logprobs, token_text, len(prompt_text))
            logprobs = {key: head[key] + tail[key] for key in head}
        text = prompt_text + text
    elif want_logprobs:
        logprobs = completion_logprobs(choice.logprobs, token_text)
    return {
        "index": choice.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
    }


# -- chat completions ---------------------------------------------------------------------


def chat_logprobs(
    entries: Sequence[common_pb2.TokenLogprob], token_text: TokenText
) -> dict[str, Any]:
    """The chat shape: per token its text, logprob, UTF-8 bytes and best alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(entry.token_id, entry.logprob),
                "top_logprobs": [item(a.token_id, a.logprob) for a in entry.top_logprobs],
            }
            for entry in entries
        ]
    }


def chat_choice(
    choice: Choice, token_text: TokenText, want_logprobs: bool, tool_mode: ToolMode | None = None
) -> dict[str, Any]:
    """With ``tool_mode`` (a forced tool call) a complete output is the message's
    ``tool_calls`` (finish reason ``tool_calls``); an incomplete one stays its content."""
    text = "".join(choice.text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish_reason = choice.finish_reason
    calls = tool_mode.tool_calls(text) if tool_mode is not None else None
    if calls is not None:
        message = {"role": "assistant", "content": None, "tool_calls": calls}
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {
        "index": choice.index,
        "message": message,
        "logprobs": chat_logprobs(choice.logprobs, token_text) if want_logprobs else None,
        "finish_reason": finish_reason,
    }


def response_body(
    kind: str, response_id: str, created: int, model: str, choices: list[dict[str, Any]],
    usage: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A whole response; ``kind``: ``text_completion`` or ``chat.completion``."""
    return {
        "id": response_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }

"""Turns a GenerateRequest / TokenizeRequest into prompt token ids, validating as it goes."""

from __future__ import annotations

from typing import Any

from common.errors import InvalidRequestError
from common.text.tokenizer import Tokenizer


def messages_from_pb(pb: Any) -> list[dict[str, str]]:
    messages = [{"role": m.role, "content": m.content} for m in pb.messages]
    if not messages:
        raise InvalidRequestError("messages", "the conversation is empty")
    return messages


def prompt_token_ids(
    request: Any, tokenizer: Tokenizer, vocab_size: int, add_generation_prompt: bool = True
) -> tuple[str, list[int]]:
    """(input field name, token ids) for a request with a ``oneof input``."""
    field = request.WhichOneof("input")
    if field is None:
        raise InvalidRequestError(
            "input", "set exactly one of prompt, messages, raw_prompt or token_ids"
        )
    if field == "prompt":
        if not request.prompt:
            raise InvalidRequestError("prompt", "the prompt is empty")
        ids = tokenizer.encode_chat(
            [{"role": "user", "content": request.prompt}], add_generation_prompt
        )
    elif field == "messages":
        ids = tokenizer.encode_chat(messages_from_pb(request.messages), add_generation_prompt)
    elif field == "raw_prompt":
        if not request.raw_prompt:
            raise InvalidRequestError("raw_prompt", "the prompt is empty")
        ids = tokenizer.encode_raw(request.raw_prompt)
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids", "no token ids given")
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("token_ids", f"token id {bad} is outside [0, {vocab_size})")
    if not ids:
        raise InvalidRequestError(field, "the input tokenizes to nothing")
    return field, ids

"""Turns a GenerateRequest / TokenizeRequest into prompt token ids, validating as it goes."""

from __future__ import annotations

from typing import Any

from common.contract.sampling import SamplingParams
from common.errors import InvalidRequestError
from common.text.tokenizer import Tokenizer

# No tokenizer we serve averages more characters per token over a whole text than this
# (English BPE: about 4; runs of whitespace in code reach 10-20), so a text longer than
# context x this cannot fit and is refused without tokenizing it.
MAX_CHARS_PER_TOKEN = 32


def check_sizes(request: Any, limit: int) -> None:
    """Refuses a GenerateRequest (or TokenizeRequest) that cannot fit a context of ``limit`` tokens, from field
    sizes alone: cheap, before admission and tokenization. The exact checks follow once
    the prompt is tokenized."""
    field = request.WhichOneof("input")
    max_chars = limit * MAX_CHARS_PER_TOKEN
    if field == "token_ids" and len(request.token_ids.ids) >= limit:
        raise InvalidRequestError(
            field,
            f"the prompt has {len(request.token_ids.ids)} tokens; the model's context holds "
            f"{limit}",
        )
    if field == "messages":
        messages = request.messages.messages
        if len(messages) >= limit:
            raise InvalidRequestError(
                field, f"{len(messages)} messages cannot fit a context of {limit} tokens"
            )
        num_chars = sum(len(m.content) + len(m.role) for m in messages)
    elif field in ("prompt", "raw_prompt"):
        num_chars = len(getattr(request, field))
    else:
        num_chars = 0
    if num_chars > max_chars:
        raise InvalidRequestError(
            field,
            f"{num_chars} characters cannot fit a context of {limit} tokens (at most "
            f"{max_chars} characters are tokenized)",
        )
    if "sampling" not in request.DESCRIPTOR.fields_by_name:
        return
    streams = request.sampling.HasField("kv_eviction")  # StreamingLLM: past the context
    if request.sampling.max_tokens >= limit and not streams:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"max_tokens ({request.sampling.max_tokens}) leaves no room for a prompt in the "
            f"context of {limit} tokens",
        )
    SamplingParams.check_pb_sizes(request.sampling)


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

"""OpenAI request bodies -> the gateway's GenerateRequest messages, and errors -> OpenAI's
error shape with the HTTP status that matches the gRPC one.

One OpenAI request becomes ``len(prompts) * n`` GenerateRequests, choice ``i`` being prompt
``i // n``'s copy ``i % n``, each under its own request id. With a ``seed``, copy ``c`` is
seeded ``seed + c``: the copies differ, and the whole response is reproducible."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from common.errors import InvalidRequestError, PdserveError
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.openai import structured
from services.gateway.openai.models import ChatCompletionRequest, CompletionRequest, _Sampling

# PdserveError.reason (the gRPC status a servicer answers with) -> HTTP status.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "KV_CAPACITY": 400,  # the request can never fit: not worth a retry
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "QUEUE_FULL": 429,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DRAINING": 503,
    "KV_LOAD_FAILED": 503,
    "DEADLINE_EXCEEDED": 504,
}
# HTTP status -> OpenAI's error ``type``.
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and error body for what the gateway raised (or pydantic rejected)."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        return 400, error_body(400, f"{param}: {first['msg']}", param, "invalid_value")
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(400, str(exc), exc.field, "invalid_value")
    if isinstance(exc, PdserveError):
        status = HTTP_STATUS.get(exc.reason, 500)
        return status, error_body(status, str(exc), None, exc.reason.lower())
    return 500, error_body(500, f"{type(exc).__name__}: {exc}")


def _sampling(
    body: _Sampling, max_tokens: int | None, logprobs: bool, top_logprobs: int, copy: int,
    prompt_logprobs: int | None = None,
    constraint: common_pb2.StructuredOutput | None = None,
) -> common_pb2.SamplingParams:  # fmt: skip
    pb = common_pb2.SamplingParams(
        max_tokens=max_tokens or 0,  # 0: what is left of the context
        top_k=max(body.top_k or 0, 0),  # -1 and 0 both mean off
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        stop=body.stop_strings(),
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if body.temperature is not None:
        pb.temperature = body.temperature
    if body.top_p is not None:
        pb.top_p = body.top_p
    if body.repetition_penalty is not None:
        pb.repetition_penalty = body.repetition_penalty
    if body.seed is not None:
        pb.seed = (body.seed + copy) % (1 << 64)
    if prompt_logprobs is not None:
        pb.prompt_logprobs = prompt_logprobs
    if constraint is not None:
        pb.structured_output.CopyFrom(constraint)
    return pb


def echo_only(body: CompletionRequest) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt returned, no token generated."""
    return body.echo and body.max_tokens == 0


def completion_requests(
    body: CompletionRequest, request_id: str
) -> list[gateway_pb2.GenerateRequest]:
    """Prompts are raw text (no chat template) or token ids. ``logprobs: k`` asks for each
    sampled token's logprob and its k best alternatives; with ``echo`` the prompt's too."""
    prompt = body.prompt
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise InvalidRequestError("prompt", "is empty")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    logprobs = body.logprobs is not None
    top = body.logprobs or 0
    echo_logprobs = top if body.echo and logprobs else None
    max_tokens = body.max_tokens
    if echo_only(body):
        # vLLM's reading: the prompt (and with logprobs its logprobs), nothing generated.
        # One token is computed with it (the prompt's logprobs come from its prefill) and
        # the server drops it.
        max_tokens = 1
    elif body.max_tokens == 0:
        raise InvalidRequestError(
            "max_tokens", "is 0, which generates nothing: ask for at least 1 token, or send "
            "echo: true for the prompt alone (with logprobs: its logprobs)")  # fmt: skip
    constraint, _ = structured.constraint(body)  # once for every prompt and copy
    out = []
    for i, text_or_ids in enumerate(prompts):
        for copy in range(body.n):
            message = gateway_pb2.GenerateRequest(
                request_id=f"{request_id}-{i * body.n + copy}",
                model=body.model,
                cache_salt=body.cache_salt,
            )
            if isinstance(text_or_ids, str):
                message.raw_prompt = text_or_ids
            else:
                if not text_or_ids:
                    raise InvalidRequestError(f"prompt[{i}]", "is empty")
                message.token_ids.ids.extend(text_or_ids)
            message.sampling.CopyFrom(
                _sampling(body, max_tokens, logprobs, top, copy, echo_logprobs, constraint)
            )
            out.append(message)
    return out


def chat_requests(
    body: ChatCompletionRequest, request_id: str
) -> list[gateway_pb2.GenerateRequest]:
    """The conversation through the model's chat template, ``n`` times."""
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise InvalidRequestError(
            "max_completion_tokens",
            f"{body.max_completion_tokens} differs from max_tokens {body.max_tokens}; send one",
        )
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    messages = gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role=m.role, content=m.text()) for m in body.messages]
    )
    constraint, _ = structured.constraint(body)  # once for every copy
    out = []
    for copy in range(body.n):
        message = gateway_pb2.GenerateRequest(
            request_id=f"{request_id}-{copy}", model=body.model, cache_salt=body.cache_salt
        )
        message.messages.CopyFrom(messages)
        message.sampling.CopyFrom(
            _sampling(body, max_tokens, body.logprobs, body.top_logprobs or 0, copy,
                      constraint=constraint)
        )
        out.append(message)
    return out

"""Request bodies of POST /v1/completions and POST /v1/chat/completions, as the OpenAI API
and vLLM's extras define them. Unknown fields are ignored (clients send ``user``,
``metadata`` and newer fields freely), as vLLM does; the bounds below are checked here, the
rest (context length, vocabulary, stop-string sizes) by the gateway as for gRPC requests."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # copies of one prompt per request (each is a request on the stack)
MAX_LOGPROBS = 20  # alternatives per token, as the gRPC API allows


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = ""
    description: str | None = None
    schema_: Annotated[Any, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str = ""
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # vLLM's extra sampling parameters.
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    cache_salt: str = ""  # vLLM's: requests share cached KV only under the same salt
    # Structured output (openai/structured.py): OpenAI's response_format, vLLM's extras.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or
    a list of token-id lists; each prompt is completed ``n`` times."""

    prompt: (
        str
        | list[str]
        | list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. ``max_completion_tokens`` is the newer name of
    ``max_tokens``; when both are given they must agree."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Function tools; only a forced call ("required" or a named one) is constrained.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

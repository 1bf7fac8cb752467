from pdserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CircuitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CIRCUIT_STATE_UNSPECIFIED: _ClassVar[CircuitState]
    CIRCUIT_STATE_CLOSED: _ClassVar[CircuitState]
    CIRCUIT_STATE_OPEN: _ClassVar[CircuitState]
    CIRCUIT_STATE_HALF_OPEN: _ClassVar[CircuitState]
CIRCUIT_STATE_UNSPECIFIED: CircuitState
CIRCUIT_STATE_CLOSED: CircuitState
CIRCUIT_STATE_OPEN: CircuitState
CIRCUIT_STATE_HALF_OPEN: CircuitState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "raw_prompt", "token_ids", "sampling", "request_id", "model", "cache_salt", "resume")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    raw_prompt: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    request_id: str
    model: str
    cache_salt: str
    resume: ResumeFrom
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., raw_prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ..., resume: _Optional[_Union[ResumeFrom, _Mapping]] = ...) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("resume_token", "token_ids")
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    resume_token: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, resume_token: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "timings", "prompt_logprobs", "resume_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    resume_token: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., resume_token: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "max_context_tokens", "vocab_size", "eos_token_ids", "has_chat_template", "block_size", "hash_scheme_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    max_context_tokens: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    block_size: int
    hash_scheme_version: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., block_size: _Optional[int] = ..., hash_scheme_version: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "raw_prompt", "add_generation_prompt", "model")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    raw_prompt: str
    add_generation_prompt: bool
    model: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., raw_prompt: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterStatusResponse(_message.Message):
    __slots__ = ("workers", "routing_index", "circuits")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_INDEX_FIELD_NUMBER: _ClassVar[int]
    CIRCUITS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerStatus]
    routing_index: RoutingIndexStatus
    circuits: _containers.RepeatedCompositeFieldContainer[CircuitStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerStatus, _Mapping]]] = ..., routing_index: _Optional[_Union[RoutingIndexStatus, _Mapping]] = ..., circuits: _Optional[_Iterable[_Union[CircuitStatus, _Mapping]]] = ...) -> None: ...

class RoutingIndexStatus(_message.Message):
    __slots__ = ("available", "error", "unavailable_since_unix_ms")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    available: bool
    error: str
    unavailable_since_unix_ms: int
    def __init__(self, available: _Optional[bool] = ..., error: _Optional[str] = ..., unavailable_since_unix_ms: _Optional[int] = ...) -> None: ...

class CircuitStatus(_message.Message):
    __slots__ = ("worker_id", "state", "consecutive_failures")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: CircuitState
    consecutive_failures: int
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[_Union[CircuitState, str]] = ..., consecutive_failures: _Optional[int] = ...) -> None: ...

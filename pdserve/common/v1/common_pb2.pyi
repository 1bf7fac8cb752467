from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_INT8: _ClassVar[KvDtype]
    KV_DTYPE_FP8_E4M3: _ClassVar[KvDtype]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BLOCK_STORE: _ClassVar[WorkerRole]
    WORKER_ROLE_GATEWAY: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PLANNER: _ClassVar[WorkerRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_INT8: KvDtype
KV_DTYPE_FP8_E4M3: KvDtype
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BLOCK_STORE: WorkerRole
WORKER_ROLE_GATEWAY: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PLANNER: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "disable_speculation", "min_tokens", "structured_output", "kv_eviction", "kv_compression")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTION_FIELD_NUMBER: _ClassVar[int]
    KV_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    disable_speculation: bool
    min_tokens: int
    structured_output: StructuredOutput
    kv_eviction: KvEviction
    kv_compression: KvCompression
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., disable_speculation: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., kv_eviction: _Optional[_Union[KvEviction, _Mapping]] = ..., kv_compression: _Optional[_Union[KvCompression, _Mapping]] = ...) -> None: ...

class KvEviction(_message.Message):
    __slots__ = ("sink_tokens", "window_tokens")
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sink_tokens: int
    window_tokens: int
    def __init__(self, sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class KvCompression(_message.Message):
    __slots__ = ("budget_tokens", "window_tokens")
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    budget_tokens: int
    window_tokens: int
    def __init__(self, budget_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "bytes_per_block", "scales_offset_bytes")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SCALES_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: KvDtype
    bytes_per_block: int
    scales_offset_bytes: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., bytes_per_block: _Optional[int] = ..., scales_offset_bytes: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("request_id", "hash_scheme_version", "block_hashes", "num_tokens", "layout", "producer_address", "lease_id", "lease_expiry_unix_ms", "model", "weight_format", "kept_block_indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KEPT_BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hash_scheme_version: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout: KvLayout
    producer_address: str
    lease_id: str
    lease_expiry_unix_ms: int
    model: str
    weight_format: str
    kept_block_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., hash_scheme_version: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., producer_address: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_expiry_unix_ms: _Optional[int] = ..., model: _Optional[str] = ..., weight_format: _Optional[str] = ..., kept_block_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "address", "model", "num_kv_blocks_total", "num_kv_blocks_free", "num_running_requests", "num_waiting_requests", "prefix_cache_hit_rate", "pid", "draining", "weight_format", "endpoints", "profile", "role_since_unix_ms", "num_role_changes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ROLE_SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLE_CHANGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    model: str
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_running_requests: int
    num_waiting_requests: int
    prefix_cache_hit_rate: float
    pid: int
    draining: bool
    weight_format: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    profile: WorkerProfile
    role_since_unix_ms: int
    num_role_changes: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., pid: _Optional[int] = ..., draining: _Optional[bool] = ..., weight_format: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., profile: _Optional[_Union[WorkerProfile, _Mapping]] = ..., role_since_unix_ms: _Optional[int] = ..., num_role_changes: _Optional[int] = ...) -> None: ...

class WorkerProfile(_message.Message):
    __slots__ = ("model", "weight_format", "num_threads", "device", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "prefill_samples", "decode_samples", "prefill_fit", "decode_fit", "measured_unix_ms", "measure_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIT_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURE_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    weight_format: str
    num_threads: int
    device: str
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    prefill_samples: _containers.RepeatedCompositeFieldContainer[PrefillSample]
    decode_samples: _containers.RepeatedCompositeFieldContainer[DecodeSample]
    prefill_fit: PrefillFit
    decode_fit: DecodeFit
    measured_unix_ms: int
    measure_ms: float
    def __init__(self, model: _Optional[str] = ..., weight_format: _Optional[str] = ..., num_threads: _Optional[int] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., prefill_samples: _Optional[_Iterable[_Union[PrefillSample, _Mapping]]] = ..., decode_samples: _Optional[_Iterable[_Union[DecodeSample, _Mapping]]] = ..., prefill_fit: _Optional[_Union[PrefillFit, _Mapping]] = ..., decode_fit: _Optional[_Union[DecodeFit, _Mapping]] = ..., measured_unix_ms: _Optional[int] = ..., measure_ms: _Optional[float] = ...) -> None: ...

class PrefillSample(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class DecodeSample(_message.Message):
    __slots__ = ("batch_size", "context_tokens", "step_ms")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    context_tokens: int
    step_ms: float
    def __init__(self, batch_size: _Optional[int] = ..., context_tokens: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class PrefillFit(_message.Message):
    __slots__ = ("base_ms", "per_token_ms", "per_attended_token_ms")
    BASE_MS_FIELD_NUMBER: _ClassVar[int]
    PER_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    PER_ATTENDED_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    base_ms: float
    per_token_ms: float
    per_attended_token_ms: float
    def __init__(self, base_ms: _Optional[float] = ..., per_token_ms: _Optional[float] = ..., per_attended_token_ms: _Optional[float] = ...) -> None: ...

class DecodeFit(_message.Message):
    __slots__ = ("base_ms", "per_sequence_ms", "per_context_token_ms")
    BASE_MS_FIELD_NUMBER: _ClassVar[int]
    PER_SEQUENCE_MS_FIELD_NUMBER: _ClassVar[int]
    PER_CONTEXT_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    base_ms: float
    per_sequence_ms: float
    per_context_token_ms: float
    def __init__(self, base_ms: _Optional[float] = ..., per_sequence_ms: _Optional[float] = ..., per_context_token_ms: _Optional[float] = ...) -> None: ...

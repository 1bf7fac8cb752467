from pdserve.common.v1 import common_pb2 as _common_pb2
from pdserve.kv.v1 import kv_chunk_pb2 as _kv_chunk_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BeginPutRequest(_message.Message):
    __slots__ = ("block_hashes", "layout", "model", "hash_scheme_version")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    layout: _common_pb2.KvLayout
    model: str
    hash_scheme_version: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., model: _Optional[str] = ..., hash_scheme_version: _Optional[int] = ...) -> None: ...

class BeginPutResponse(_message.Message):
    __slots__ = ("put_id", "missing_block_hashes", "put_expiry_unix_ms")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PUT_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    missing_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    put_expiry_unix_ms: int
    def __init__(self, put_id: _Optional[str] = ..., missing_block_hashes: _Optional[_Iterable[int]] = ..., put_expiry_unix_ms: _Optional[int] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("put_id", "chunk")
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    chunk: _kv_chunk_pb2.KvBlockChunk
    def __init__(self, put_id: _Optional[str] = ..., chunk: _Optional[_Union[_kv_chunk_pb2.KvBlockChunk, _Mapping]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("num_blocks_received",)
    NUM_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_received: int
    def __init__(self, num_blocks_received: _Optional[int] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("put_id",)
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    def __init__(self, put_id: _Optional[str] = ...) -> None: ...

class CommitPutResponse(_message.Message):
    __slots__ = ("num_blocks_committed",)
    NUM_BLOCKS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_committed: int
    def __init__(self, num_blocks_committed: _Optional[int] = ...) -> None: ...

class AbortPutRequest(_message.Message):
    __slots__ = ("put_id",)
    PUT_ID_FIELD_NUMBER: _ClassVar[int]
    put_id: str
    def __init__(self, put_id: _Optional[str] = ...) -> None: ...

class AbortPutResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "model", "hash_scheme_version", "max_chunk_bytes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    model: str
    hash_scheme_version: int
    max_chunk_bytes: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., hash_scheme_version: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("chunk", "layout")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    chunk: _kv_chunk_pb2.KvBlockChunk
    layout: _common_pb2.KvLayout
    def __init__(self, chunk: _Optional[_Union[_kv_chunk_pb2.KvBlockChunk, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ...) -> None: ...

class ContainsBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "model", "hash_scheme_version")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_VERSION_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    model: str
    hash_scheme_version: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., hash_scheme_version: _Optional[int] = ...) -> None: ...

class ContainsBlocksResponse(_message.Message):
    __slots__ = ("num_prefix_present", "present")
    NUM_PREFIX_PRESENT_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_prefix_present: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, num_prefix_present: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.WorkerStatus
    def __init__(self, status: _Optional[_Union[_common_pb2.WorkerStatus, _Mapping]] = ...) -> None: ...

from pdserve.common.v1 import common_pb2 as _common_pb2
from pdserve.kv.v1 import kv_chunk_pb2 as _kv_chunk_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullBlocksRequest(_message.Message):
    __slots__ = ("lease_id", "request_id", "max_chunk_bytes", "start_block_index")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    max_chunk_bytes: int
    start_block_index: int
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., start_block_index: _Optional[int] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("chunk", "layout")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    chunk: _kv_chunk_pb2.KvBlockChunk
    layout: _common_pb2.KvLayout
    def __init__(self, chunk: _Optional[_Union[_kv_chunk_pb2.KvBlockChunk, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

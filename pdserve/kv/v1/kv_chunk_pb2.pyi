from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KvBlockChunk(_message.Message):
    __slots__ = ("block_index", "block_hash", "offset_bytes", "data", "last_chunk_of_block", "block_crc32c")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_OF_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRC32C_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    block_hash: int
    offset_bytes: int
    data: bytes
    last_chunk_of_block: bool
    block_crc32c: int
    def __init__(self, block_index: _Optional[int] = ..., block_hash: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., last_chunk_of_block: _Optional[bool] = ..., block_crc32c: _Optional[int] = ...) -> None: ...

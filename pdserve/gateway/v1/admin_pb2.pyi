from pdserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetWorkerRoleRequest(_message.Message):
    __slots__ = ("worker_id", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _common_pb2.WorkerRole
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ...) -> None: ...

class SetWorkerRoleResponse(_message.Message):
    __slots__ = ("worker_id", "previous_role", "role", "num_streams_moved", "elapsed_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_MOVED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    previous_role: _common_pb2.WorkerRole
    role: _common_pb2.WorkerRole
    num_streams_moved: int
    elapsed_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., previous_role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., num_streams_moved: _Optional[int] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...

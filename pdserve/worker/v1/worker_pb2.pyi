from pdserve.common.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role", "num_streams_moved", "elapsed_ms")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_MOVED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    previous_role: _common_pb2.WorkerRole
    role: _common_pb2.WorkerRole
    num_streams_moved: int
    elapsed_ms: float
    def __init__(self, previous_role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., num_streams_moved: _Optional[int] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...

class GetProfileRequest(_message.Message):
    __slots__ = ("remeasure",)
    REMEASURE_FIELD_NUMBER: _ClassVar[int]
    remeasure: bool
    def __init__(self, remeasure: _Optional[bool] = ...) -> None: ...

class GetProfileResponse(_message.Message):
    __slots__ = ("profile",)
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    profile: _common_pb2.WorkerProfile
    def __init__(self, profile: _Optional[_Union[_common_pb2.WorkerProfile, _Mapping]] = ...) -> None: ...

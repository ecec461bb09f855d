from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor
CALL_FIELD_NUMBER: _ClassVar[int]
call: _descriptor.FieldDescriptor

class CallRule(_message.Message):
    __slots__ = ("routing_field", "keyed", "scope")
    ROUTING_FIELD_FIELD_NUMBER: _ClassVar[int]
    KEYED_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    routing_field: str
    keyed: bool
    scope: str
    def __init__(self, routing_field: _Optional[str] = ..., keyed: _Optional[bool] = ..., scope: _Optional[str] = ...) -> None: ...

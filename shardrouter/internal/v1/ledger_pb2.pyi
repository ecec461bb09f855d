from shardrouter.v1 import options_pb2 as _options_pb2
from shardrouter.v1 import transfer_pb2 as _transfer_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreditTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "source_shard_id", "source_account_id", "destination_account_id", "amount")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    source_shard_id: str
    source_account_id: str
    destination_account_id: str
    amount: _transfer_pb2.Money
    def __init__(self, transfer_id: _Optional[str] = ..., source_shard_id: _Optional[str] = ..., source_account_id: _Optional[str] = ..., destination_account_id: _Optional[str] = ..., amount: _Optional[_Union[_transfer_pb2.Money, _Mapping]] = ...) -> None: ...

class CreditTransferResponse(_message.Message):
    __slots__ = ("entry_id",)
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    def __init__(self, entry_id: _Optional[str] = ...) -> None: ...

class VoidCreditRequest(_message.Message):
    __slots__ = ("transfer_id", "reason", "destination_account_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    destination_account_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., destination_account_id: _Optional[str] = ...) -> None: ...

class VoidCreditResponse(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class RefundTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "reason", "source_account_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    source_account_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., source_account_id: _Optional[str] = ...) -> None: ...

class RefundTransferResponse(_message.Message):
    __slots__ = ("entry_id",)
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    def __init__(self, entry_id: _Optional[str] = ...) -> None: ...

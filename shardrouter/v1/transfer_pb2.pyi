import datetime

from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from shardrouter.v1 import options_pb2 as _options_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_PENDING: _ClassVar[TransferState]
    TRANSFER_STATE_COMPLETED: _ClassVar[TransferState]
    TRANSFER_STATE_REFUNDED: _ClassVar[TransferState]

class AccountState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCOUNT_STATE_UNSPECIFIED: _ClassVar[AccountState]
    ACCOUNT_STATE_OPEN: _ClassVar[AccountState]
    ACCOUNT_STATE_CLOSED: _ClassVar[AccountState]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_PENDING: TransferState
TRANSFER_STATE_COMPLETED: TransferState
TRANSFER_STATE_REFUNDED: TransferState
ACCOUNT_STATE_UNSPECIFIED: AccountState
ACCOUNT_STATE_OPEN: AccountState
ACCOUNT_STATE_CLOSED: AccountState

class Money(_message.Message):
    __slots__ = ("amount_minor", "currency")
    AMOUNT_MINOR_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    amount_minor: int
    currency: str
    def __init__(self, amount_minor: _Optional[int] = ..., currency: _Optional[str] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("source_account_id", "destination_account_id", "amount", "reference")
    SOURCE_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    source_account_id: str
    destination_account_id: str
    amount: Money
    reference: str
    def __init__(self, source_account_id: _Optional[str] = ..., destination_account_id: _Optional[str] = ..., amount: _Optional[_Union[Money, _Mapping]] = ..., reference: _Optional[str] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("transfer_id", "source_account_id", "destination_account_id", "amount", "state", "reference", "created_at", "updated_at", "delivery_attempts")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    source_account_id: str
    destination_account_id: str
    amount: Money
    state: TransferState
    reference: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    delivery_attempts: _containers.RepeatedCompositeFieldContainer[DeliveryAttempt]
    def __init__(self, transfer_id: _Optional[str] = ..., source_account_id: _Optional[str] = ..., destination_account_id: _Optional[str] = ..., amount: _Optional[_Union[Money, _Mapping]] = ..., state: _Optional[_Union[TransferState, str]] = ..., reference: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., delivery_attempts: _Optional[_Iterable[_Union[DeliveryAttempt, _Mapping]]] = ...) -> None: ...

class DeliveryAttempt(_message.Message):
    __slots__ = ("attempted_at", "status_code", "message")
    ATTEMPTED_AT_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    attempted_at: _timestamp_pb2.Timestamp
    status_code: str
    message: str
    def __init__(self, attempted_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., status_code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DepositRequest(_message.Message):
    __slots__ = ("account_id", "amount", "reference")
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    account_id: str
    amount: Money
    reference: str
    def __init__(self, account_id: _Optional[str] = ..., amount: _Optional[_Union[Money, _Mapping]] = ..., reference: _Optional[str] = ...) -> None: ...

class DepositResponse(_message.Message):
    __slots__ = ("entry_id", "balance")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    balance: Money
    def __init__(self, entry_id: _Optional[str] = ..., balance: _Optional[_Union[Money, _Mapping]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("source_account_id", "transfer_id", "wait_for_completion_ms")
    SOURCE_ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_COMPLETION_MS_FIELD_NUMBER: _ClassVar[int]
    source_account_id: str
    transfer_id: str
    wait_for_completion_ms: int
    def __init__(self, source_account_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., wait_for_completion_ms: _Optional[int] = ...) -> None: ...

class GetTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class GetBalanceRequest(_message.Message):
    __slots__ = ("account_id",)
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    account_id: str
    def __init__(self, account_id: _Optional[str] = ...) -> None: ...

class GetBalanceResponse(_message.Message):
    __slots__ = ("account_id", "balance", "state")
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    account_id: str
    balance: Money
    state: AccountState
    def __init__(self, account_id: _Optional[str] = ..., balance: _Optional[_Union[Money, _Mapping]] = ..., state: _Optional[_Union[AccountState, str]] = ...) -> None: ...

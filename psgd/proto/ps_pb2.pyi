from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "plan_hash", "plan_json", "hostname", "pid", "clock", "job_json", "incarnation", "any_rank")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    JOB_JSON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ANY_RANK_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    plan_hash: str
    plan_json: str
    hostname: str
    pid: int
    clock: int
    job_json: str
    incarnation: str
    any_rank: bool
    def __init__(self, worker_id: _Optional[int] = ..., plan_hash: _Optional[str] = ..., plan_json: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., clock: _Optional[int] = ..., job_json: _Optional[str] = ..., incarnation: _Optional[str] = ..., any_rank: _Optional[bool] = ...) -> None: ...

class ErrorInfo(_message.Message):
    __slots__ = ("reason", "differences", "rewind_to", "holder_host", "holder_pid")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[ErrorInfo.Reason]
        NOT_REGISTERED: _ClassVar[ErrorInfo.Reason]
        JOB_MISMATCH: _ClassVar[ErrorInfo.Reason]
        ROLLED_BACK: _ClassVar[ErrorInfo.Reason]
        NOT_PRIMARY: _ClassVar[ErrorInfo.Reason]
        RANK_HELD: _ClassVar[ErrorInfo.Reason]
    REASON_UNSPECIFIED: ErrorInfo.Reason
    NOT_REGISTERED: ErrorInfo.Reason
    JOB_MISMATCH: ErrorInfo.Reason
    ROLLED_BACK: ErrorInfo.Reason
    NOT_PRIMARY: ErrorInfo.Reason
    RANK_HELD: ErrorInfo.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    REWIND_TO_FIELD_NUMBER: _ClassVar[int]
    HOLDER_HOST_FIELD_NUMBER: _ClassVar[int]
    HOLDER_PID_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorInfo.Reason
    differences: _containers.RepeatedScalarFieldContainer[str]
    rewind_to: int
    holder_host: str
    holder_pid: int
    def __init__(self, reason: _Optional[_Union[ErrorInfo.Reason, str]] = ..., differences: _Optional[_Iterable[str]] = ..., rewind_to: _Optional[int] = ..., holder_host: _Optional[str] = ..., holder_pid: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_id", "clock", "lease_seconds", "shard", "num_shards", "num_workers", "policy", "incarnation", "version", "data_port", "host_id", "rollback_to", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_TO_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    lease_seconds: float
    shard: int
    num_shards: int
    num_workers: int
    policy: str
    incarnation: str
    version: int
    data_port: int
    host_id: str
    rollback_to: int
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., num_workers: _Optional[int] = ..., policy: _Optional[str] = ..., incarnation: _Optional[str] = ..., version: _Optional[int] = ..., data_port: _Optional[int] = ..., host_id: _Optional[str] = ..., rollback_to: _Optional[int] = ..., registration: _Optional[str] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("worker_id", "to_version", "cause", "dry_run", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    to_version: int
    cause: str
    dry_run: bool
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., to_version: _Optional[int] = ..., cause: _Optional[str] = ..., dry_run: _Optional[bool] = ..., registration: _Optional[str] = ...) -> None: ...

class RollbackReply(_message.Message):
    __slots__ = ("version", "cuts", "rounds_undone")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CUTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_UNDONE_FIELD_NUMBER: _ClassVar[int]
    version: int
    cuts: _containers.RepeatedScalarFieldContainer[int]
    rounds_undone: int
    def __init__(self, version: _Optional[int] = ..., cuts: _Optional[_Iterable[int]] = ..., rounds_undone: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "rows", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    rows: _containers.RepeatedCompositeFieldContainer[RowBlock]
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ..., registration: _Optional[str] = ...) -> None: ...

class ListRowsRequest(_message.Message):
    __slots__ = ("table", "start", "max_rows")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    table: str
    start: int
    max_rows: int
    def __init__(self, table: _Optional[str] = ..., start: _Optional[int] = ..., max_rows: _Optional[int] = ...) -> None: ...

class ListRowsReply(_message.Message):
    __slots__ = ("rows", "next", "version")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rows: RowBlock
    next: int
    version: int
    def __init__(self, rows: _Optional[_Union[RowBlock, _Mapping]] = ..., next: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("table", "ids", "values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    values: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("slice_id", "offset", "data", "version", "rows", "pushed")
    SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    slice_id: int
    offset: int
    data: bytes
    version: int
    rows: RowBlock
    pushed: PushReply
    def __init__(self, slice_id: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., version: _Optional[int] = ..., rows: _Optional[_Union[RowBlock, _Mapping]] = ..., pushed: _Optional[_Union[PushReply, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "clock", "base_version", "dtype", "rows", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    base_version: int
    dtype: str
    rows: int
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., base_version: _Optional[int] = ..., dtype: _Optional[str] = ..., rows: _Optional[int] = ..., registration: _Optional[str] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk", "rows")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    rows: RowBlock
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., rows: _Optional[_Union[RowBlock, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "next_clock", "version", "staleness")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NEXT_CLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    next_clock: int
    version: int
    staleness: int
    def __init__(self, outcome: _Optional[str] = ..., next_clock: _Optional[int] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., registration: _Optional[str] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "blocks", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    blocks: int
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., blocks: _Optional[int] = ..., registration: _Optional[str] = ...) -> None: ...

class BatchReply(_message.Message):
    __slots__ = ("block",)
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    block: int
    def __init__(self, block: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_seconds", "version")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    version: int
    def __init__(self, lease_seconds: _Optional[float] = ..., version: _Optional[int] = ...) -> None: ...

class DoneRequest(_message.Message):
    __slots__ = ("worker_id", "clock", "registration")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    clock: int
    registration: str
    def __init__(self, worker_id: _Optional[int] = ..., clock: _Optional[int] = ..., registration: _Optional[str] = ...) -> None: ...

class DoneReply(_message.Message):
    __slots__ = ("live_workers",)
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    live_workers: int
    def __init__(self, live_workers: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("challenge", "ticket")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    challenge: str
    ticket: str
    def __init__(self, challenge: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "state", "clock", "lease_left_seconds", "hostname", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    state: str
    clock: int
    lease_left_seconds: float
    hostname: str
    pid: int
    def __init__(self, worker_id: _Optional[int] = ..., state: _Optional[str] = ..., clock: _Optional[int] = ..., lease_left_seconds: _Optional[float] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard", "num_shards", "policy", "version", "workers", "plan_hash", "bytes_held", "counters_json", "staleness_histogram", "incarnation", "data_port", "role", "replica_lag", "proof", "follower")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LAG_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    policy: str
    version: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    plan_hash: str
    bytes_held: int
    counters_json: str
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    incarnation: str
    data_port: int
    role: str
    replica_lag: int
    proof: str
    follower: str
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., policy: _Optional[str] = ..., version: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., plan_hash: _Optional[str] = ..., bytes_held: _Optional[int] = ..., counters_json: _Optional[str] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., incarnation: _Optional[str] = ..., data_port: _Optional[int] = ..., role: _Optional[str] = ..., replica_lag: _Optional[int] = ..., proof: _Optional[str] = ..., follower: _Optional[str] = ...) -> None: ...

from chorus.v1 import common_pb2 as _common_pb2
from chorus.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoreHelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CoreHello(_message.Message):
    __slots__ = ("worker", "canvas_workers", "default_model", "kv_pages", "page_size")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CANVAS_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker: _worker_pb2.Hello
    canvas_workers: _containers.RepeatedCompositeFieldContainer[_worker_pb2.Hello]
    default_model: str
    kv_pages: int
    page_size: int
    def __init__(self, worker: _Optional[_Union[_worker_pb2.Hello, _Mapping]] = ..., canvas_workers: _Optional[_Iterable[_Union[_worker_pb2.Hello, _Mapping]]] = ..., default_model: _Optional[str] = ..., kv_pages: _Optional[int] = ..., page_size: _Optional[int] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("ticket", "prompt_rows", "sampling", "max_frames")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    prompt_rows: _common_pb2.IntMatrix
    sampling: _worker_pb2.SamplingConfig
    max_frames: int
    def __init__(self, ticket: _Optional[int] = ..., prompt_rows: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., sampling: _Optional[_Union[_worker_pb2.SamplingConfig, _Mapping]] = ..., max_frames: _Optional[int] = ...) -> None: ...

class CanvasSubmit(_message.Message):
    __slots__ = ("ticket", "model", "canvas")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CANVAS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    model: str
    canvas: _worker_pb2.CanvasStart
    def __init__(self, ticket: _Optional[int] = ..., model: _Optional[str] = ..., canvas: _Optional[_Union[_worker_pb2.CanvasStart, _Mapping]] = ...) -> None: ...

class CanvasDone(_message.Message):
    __slots__ = ("ticket", "codes", "error", "queue_ms", "generate_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    codes: _common_pb2.IntMatrix
    error: str
    queue_ms: float
    generate_ms: float
    def __init__(self, ticket: _Optional[int] = ..., codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., error: _Optional[str] = ..., queue_ms: _Optional[float] = ..., generate_ms: _Optional[float] = ...) -> None: ...

class Submitted(_message.Message):
    __slots__ = ("ticket", "request_id", "queue_full", "loaded", "unavailable", "retry_after_s")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FULL_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    request_id: int
    queue_full: str
    loaded: bool
    unavailable: str
    retry_after_s: float
    def __init__(self, ticket: _Optional[int] = ..., request_id: _Optional[int] = ..., queue_full: _Optional[str] = ..., loaded: _Optional[bool] = ..., unavailable: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    def __init__(self, ticket: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("ticket", "reason", "error", "frames", "queue_ms", "cached_prompt_rows", "unavailable")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    reason: str
    error: str
    frames: int
    queue_ms: float
    cached_prompt_rows: int
    unavailable: bool
    def __init__(self, ticket: _Optional[int] = ..., reason: _Optional[str] = ..., error: _Optional[str] = ..., frames: _Optional[int] = ..., queue_ms: _Optional[float] = ..., cached_prompt_rows: _Optional[int] = ..., unavailable: _Optional[bool] = ...) -> None: ...

class WorkerHealth(_message.Message):
    __slots__ = ("down", "queued", "running", "draining")
    DOWN_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    down: _containers.RepeatedScalarFieldContainer[str]
    queued: int
    running: int
    draining: bool
    def __init__(self, down: _Optional[_Iterable[str]] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class Pause(_message.Message):
    __slots__ = ("ticket", "paused")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    paused: bool
    def __init__(self, ticket: _Optional[int] = ..., paused: _Optional[bool] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("tickets", "indices", "rows", "finished")
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tickets: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    rows: _common_pb2.IntMatrix
    finished: _containers.RepeatedCompositeFieldContainer[Finished]
    def __init__(self, tickets: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., finished: _Optional[_Iterable[_Union[Finished, _Mapping]]] = ...) -> None: ...

class StoredVoice(_message.Message):
    __slots__ = ("voice_id", "codes", "transcript", "frames", "model", "rms", "owner", "created_at")
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RMS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    voice_id: str
    codes: _common_pb2.IntMatrix
    transcript: str
    frames: int
    model: str
    rms: float
    owner: str
    created_at: int
    def __init__(self, voice_id: _Optional[str] = ..., codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., transcript: _Optional[str] = ..., frames: _Optional[int] = ..., model: _Optional[str] = ..., rms: _Optional[float] = ..., owner: _Optional[str] = ..., created_at: _Optional[int] = ...) -> None: ...

class EvictPrefix(_message.Message):
    __slots__ = ("rows", "shared_rows")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SHARED_ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _common_pb2.IntMatrix
    shared_rows: int
    def __init__(self, rows: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., shared_rows: _Optional[int] = ...) -> None: ...

class CallReport(_message.Message):
    __slots__ = ("event", "ttfa_s", "outcome")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    TTFA_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    event: str
    ttfa_s: float
    outcome: str
    def __init__(self, event: _Optional[str] = ..., ttfa_s: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

class FrontendMessage(_message.Message):
    __slots__ = ("call", "hello", "submit", "abort", "report", "canvas_submit", "pause", "evict_prefix")
    CALL_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    CANVAS_SUBMIT_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    EVICT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    call: int
    hello: CoreHelloRequest
    submit: Submit
    abort: Abort
    report: CallReport
    canvas_submit: CanvasSubmit
    pause: Pause
    evict_prefix: EvictPrefix
    def __init__(self, call: _Optional[int] = ..., hello: _Optional[_Union[CoreHelloRequest, _Mapping]] = ..., submit: _Optional[_Union[Submit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., report: _Optional[_Union[CallReport, _Mapping]] = ..., canvas_submit: _Optional[_Union[CanvasSubmit, _Mapping]] = ..., pause: _Optional[_Union[Pause, _Mapping]] = ..., evict_prefix: _Optional[_Union[EvictPrefix, _Mapping]] = ...) -> None: ...

class CoreMessage(_message.Message):
    __slots__ = ("call", "hello", "submitted", "progress", "canvas_done", "health")
    CALL_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    CANVAS_DONE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    call: int
    hello: CoreHello
    submitted: Submitted
    progress: Progress
    canvas_done: CanvasDone
    health: WorkerHealth
    def __init__(self, call: _Optional[int] = ..., hello: _Optional[_Union[CoreHello, _Mapping]] = ..., submitted: _Optional[_Union[Submitted, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., canvas_done: _Optional[_Union[CanvasDone, _Mapping]] = ..., health: _Optional[_Union[WorkerHealth, _Mapping]] = ...) -> None: ...

from chorus.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecoderJob(_message.Message):
    __slots__ = ("job", "stream", "codes", "int16")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    INT16_FIELD_NUMBER: _ClassVar[int]
    job: int
    stream: int
    codes: _common_pb2.IntMatrix
    int16: bool
    def __init__(self, job: _Optional[int] = ..., stream: _Optional[int] = ..., codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., int16: _Optional[bool] = ...) -> None: ...

class DecoderInput(_message.Message):
    __slots__ = ("jobs", "released", "shutdown", "hello")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[DecoderJob]
    released: _containers.RepeatedScalarFieldContainer[int]
    shutdown: bool
    hello: bool
    def __init__(self, jobs: _Optional[_Iterable[_Union[DecoderJob, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., shutdown: _Optional[bool] = ..., hello: _Optional[bool] = ...) -> None: ...

class DecoderReady(_message.Message):
    __slots__ = ("slots", "n_q", "max_stream_frames", "attention", "glue", "glue_fallback", "incarnation", "pid", "hosted", "graph_frames", "step_frames")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    N_Q_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    GLUE_FIELD_NUMBER: _ClassVar[int]
    GLUE_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTED_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FRAMES_FIELD_NUMBER: _ClassVar[int]
    STEP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    slots: int
    n_q: int
    max_stream_frames: int
    attention: str
    glue: str
    glue_fallback: str
    incarnation: int
    pid: int
    hosted: bool
    graph_frames: _containers.RepeatedScalarFieldContainer[int]
    step_frames: int
    def __init__(self, slots: _Optional[int] = ..., n_q: _Optional[int] = ..., max_stream_frames: _Optional[int] = ..., attention: _Optional[str] = ..., glue: _Optional[str] = ..., glue_fallback: _Optional[str] = ..., incarnation: _Optional[int] = ..., pid: _Optional[int] = ..., hosted: _Optional[bool] = ..., graph_frames: _Optional[_Iterable[int]] = ..., step_frames: _Optional[int] = ...) -> None: ...

class DecoderJobDone(_message.Message):
    __slots__ = ("job", "error", "message")
    class Error(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[DecoderJobDone.Error]
        STREAM_TOO_LONG: _ClassVar[DecoderJobDone.Error]
        FAILED: _ClassVar[DecoderJobDone.Error]
    NONE: DecoderJobDone.Error
    STREAM_TOO_LONG: DecoderJobDone.Error
    FAILED: DecoderJobDone.Error
    JOB_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job: int
    error: DecoderJobDone.Error
    message: str
    def __init__(self, job: _Optional[int] = ..., error: _Optional[_Union[DecoderJobDone.Error, str]] = ..., message: _Optional[str] = ...) -> None: ...

class DecoderReport(_message.Message):
    __slots__ = ("free_slots", "waiting_streams", "stepped", "step_ms", "step_streams", "graphed", "step_frames", "queue_wait_ms", "launched_ahead")
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_STREAMS_FIELD_NUMBER: _ClassVar[int]
    GRAPHED_FIELD_NUMBER: _ClassVar[int]
    STEP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    free_slots: int
    waiting_streams: int
    stepped: bool
    step_ms: float
    step_streams: int
    graphed: bool
    step_frames: int
    queue_wait_ms: float
    launched_ahead: bool
    def __init__(self, free_slots: _Optional[int] = ..., waiting_streams: _Optional[int] = ..., stepped: _Optional[bool] = ..., step_ms: _Optional[float] = ..., step_streams: _Optional[int] = ..., graphed: _Optional[bool] = ..., step_frames: _Optional[int] = ..., queue_wait_ms: _Optional[float] = ..., launched_ahead: _Optional[bool] = ...) -> None: ...

class ClipReport(_message.Message):
    __slots__ = ("decode_ms", "clips", "forwards")
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    CLIPS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    decode_ms: float
    clips: int
    forwards: int
    def __init__(self, decode_ms: _Optional[float] = ..., clips: _Optional[int] = ..., forwards: _Optional[int] = ...) -> None: ...

class DecoderOutput(_message.Message):
    __slots__ = ("ready", "done", "report", "clip_report")
    READY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    CLIP_REPORT_FIELD_NUMBER: _ClassVar[int]
    ready: DecoderReady
    done: DecoderJobDone
    report: DecoderReport
    clip_report: ClipReport
    def __init__(self, ready: _Optional[_Union[DecoderReady, _Mapping]] = ..., done: _Optional[_Union[DecoderJobDone, _Mapping]] = ..., report: _Optional[_Union[DecoderReport, _Mapping]] = ..., clip_report: _Optional[_Union[ClipReport, _Mapping]] = ...) -> None: ...

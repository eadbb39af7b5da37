from chorus.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingConfig(_message.Message):
    __slots__ = ("text_temperature", "text_top_p", "text_top_k", "audio_temperature", "audio_top_p", "audio_top_k", "audio_repetition_penalty", "seed", "min_frames")
    TEXT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOP_P_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOP_P_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOP_K_FIELD_NUMBER: _ClassVar[int]
    AUDIO_REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    text_temperature: float
    text_top_p: float
    text_top_k: int
    audio_temperature: float
    audio_top_p: float
    audio_top_k: int
    audio_repetition_penalty: float
    seed: int
    min_frames: int
    def __init__(self, text_temperature: _Optional[float] = ..., text_top_p: _Optional[float] = ..., text_top_k: _Optional[int] = ..., audio_temperature: _Optional[float] = ..., audio_top_p: _Optional[float] = ..., audio_top_k: _Optional[int] = ..., audio_repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., min_frames: _Optional[int] = ...) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("request_id", "rows", "kv_slots", "prefix_slots", "first_chunk", "last_chunk", "generation_step", "sampling", "prompt_length")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    rows: _common_pb2.IntMatrix
    kv_slots: _containers.RepeatedScalarFieldContainer[int]
    prefix_slots: _containers.RepeatedScalarFieldContainer[int]
    first_chunk: bool
    last_chunk: bool
    generation_step: int
    sampling: SamplingConfig
    prompt_length: int
    def __init__(self, request_id: _Optional[int] = ..., rows: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., kv_slots: _Optional[_Iterable[int]] = ..., prefix_slots: _Optional[_Iterable[int]] = ..., first_chunk: _Optional[bool] = ..., last_chunk: _Optional[bool] = ..., generation_step: _Optional[int] = ..., sampling: _Optional[_Union[SamplingConfig, _Mapping]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class DecodeItem(_message.Message):
    __slots__ = ("request_id", "kv_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    kv_slot: int
    def __init__(self, request_id: _Optional[int] = ..., kv_slot: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "release", "prefill", "decode", "canvas_start", "canvas_step")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANVAS_START_FIELD_NUMBER: _ClassVar[int]
    CANVAS_STEP_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    release: _containers.RepeatedScalarFieldContainer[int]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    decode: _containers.RepeatedCompositeFieldContainer[DecodeItem]
    canvas_start: _containers.RepeatedCompositeFieldContainer[CanvasStart]
    canvas_step: _containers.RepeatedCompositeFieldContainer[CanvasStep]
    def __init__(self, step_id: _Optional[int] = ..., release: _Optional[_Iterable[int]] = ..., prefill: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ..., decode: _Optional[_Iterable[_Union[DecodeItem, _Mapping]]] = ..., canvas_start: _Optional[_Iterable[_Union[CanvasStart, _Mapping]]] = ..., canvas_step: _Optional[_Iterable[_Union[CanvasStep, _Mapping]]] = ...) -> None: ...

class UnmaskKnobs(_message.Message):
    __slots__ = ("num_step", "guidance_scale", "t_shift", "layer_penalty_factor", "position_temperature", "class_temperature")
    NUM_STEP_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    T_SHIFT_FIELD_NUMBER: _ClassVar[int]
    LAYER_PENALTY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    POSITION_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CLASS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    num_step: int
    guidance_scale: float
    t_shift: float
    layer_penalty_factor: float
    position_temperature: float
    class_temperature: float
    def __init__(self, num_step: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., t_shift: _Optional[float] = ..., layer_penalty_factor: _Optional[float] = ..., position_temperature: _Optional[float] = ..., class_temperature: _Optional[float] = ...) -> None: ...

class CanvasStart(_message.Message):
    __slots__ = ("request_id", "text_ids", "reference_codes", "target_frames", "knobs", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_CODES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FRAMES_FIELD_NUMBER: _ClassVar[int]
    KNOBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    text_ids: _containers.RepeatedScalarFieldContainer[int]
    reference_codes: _common_pb2.IntMatrix
    target_frames: int
    knobs: UnmaskKnobs
    seed: int
    def __init__(self, request_id: _Optional[int] = ..., text_ids: _Optional[_Iterable[int]] = ..., reference_codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., target_frames: _Optional[int] = ..., knobs: _Optional[_Union[UnmaskKnobs, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class CanvasStep(_message.Message):
    __slots__ = ("request_id", "step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    step: int
    def __init__(self, request_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CanvasResult(_message.Message):
    __slots__ = ("request_id", "step", "finished", "codes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    step: int
    finished: bool
    codes: _common_pb2.IntMatrix
    def __init__(self, request_id: _Optional[int] = ..., step: _Optional[int] = ..., finished: _Optional[bool] = ..., codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ...) -> None: ...

class Journal(_message.Message):
    __slots__ = ("step_id", "request_ids", "rows", "stopped", "generation_steps", "skipped", "step_ms", "error", "incarnation", "canvases")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CANVASES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: _common_pb2.IntMatrix
    stopped: _containers.RepeatedScalarFieldContainer[bool]
    generation_steps: _containers.RepeatedScalarFieldContainer[int]
    skipped: _containers.RepeatedScalarFieldContainer[int]
    step_ms: float
    error: str
    incarnation: int
    canvases: _containers.RepeatedCompositeFieldContainer[CanvasResult]
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., stopped: _Optional[_Iterable[bool]] = ..., generation_steps: _Optional[_Iterable[int]] = ..., skipped: _Optional[_Iterable[int]] = ..., step_ms: _Optional[float] = ..., error: _Optional[str] = ..., incarnation: _Optional[int] = ..., canvases: _Optional[_Iterable[_Union[CanvasResult, _Mapping]]] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("release_all",)
    RELEASE_ALL_FIELD_NUMBER: _ClassVar[int]
    release_all: bool
    def __init__(self, release_all: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("model_name", "architecture", "model_config_json", "kv_slots", "max_batch", "max_context", "device", "dtype", "pid", "page_size", "incarnation", "max_packed_rows")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MAX_PACKED_ROWS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    model_config_json: str
    kv_slots: int
    max_batch: int
    max_context: int
    device: str
    dtype: str
    pid: int
    page_size: int
    incarnation: int
    max_packed_rows: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., model_config_json: _Optional[str] = ..., kv_slots: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., pid: _Optional[int] = ..., page_size: _Optional[int] = ..., incarnation: _Optional[int] = ..., max_packed_rows: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("active_requests", "steps", "prefill_rows", "decode_rows")
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ROWS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROWS_FIELD_NUMBER: _ClassVar[int]
    active_requests: int
    steps: int
    prefill_rows: int
    decode_rows: int
    def __init__(self, active_requests: _Optional[int] = ..., steps: _Optional[int] = ..., prefill_rows: _Optional[int] = ..., decode_rows: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("hello", "step", "stats", "shutdown")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    hello: HelloRequest
    step: StepPlan
    stats: StatsRequest
    shutdown: Shutdown
    def __init__(self, hello: _Optional[_Union[HelloRequest, _Mapping]] = ..., step: _Optional[_Union[StepPlan, _Mapping]] = ..., stats: _Optional[_Union[StatsRequest, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("hello", "journal", "stats", "error")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    journal: Journal
    stats: WorkerStats
    error: str
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., journal: _Optional[_Union[Journal, _Mapping]] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerConfig(_message.Message):
    __slots__ = ("bind", "model", "preset", "load_format", "device", "dtype", "kv_slots", "page_size", "decode_split_kv", "decode_kernel", "max_batch", "max_context", "seed", "attention", "cuda_graphs", "capture_graphs", "host_vocoder_decoder", "stall_exit_s")
    BIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DECODE_SPLIT_KV_FIELD_NUMBER: _ClassVar[int]
    DECODE_KERNEL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    HOST_VOCODER_DECODER_FIELD_NUMBER: _ClassVar[int]
    STALL_EXIT_S_FIELD_NUMBER: _ClassVar[int]
    bind: str
    model: str
    preset: str
    load_format: str
    device: str
    dtype: str
    kv_slots: int
    page_size: int
    decode_split_kv: bool
    decode_kernel: str
    max_batch: int
    max_context: int
    seed: int
    attention: str
    cuda_graphs: bool
    capture_graphs: bool
    host_vocoder_decoder: str
    stall_exit_s: float
    def __init__(self, bind: _Optional[str] = ..., model: _Optional[str] = ..., preset: _Optional[str] = ..., load_format: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_slots: _Optional[int] = ..., page_size: _Optional[int] = ..., decode_split_kv: _Optional[bool] = ..., decode_kernel: _Optional[str] = ..., max_batch: _Optional[int] = ..., max_context: _Optional[int] = ..., seed: _Optional[int] = ..., attention: _Optional[str] = ..., cuda_graphs: _Optional[bool] = ..., capture_graphs: _Optional[bool] = ..., host_vocoder_decoder: _Optional[str] = ..., stall_exit_s: _Optional[float] = ...) -> None: ...

class VocoderConfig(_message.Message):
    __slots__ = ("host", "port", "metrics_port", "codec", "preset", "device", "dtype", "first_chunk_frames", "chunk_frames", "encode_cache_size", "engine", "slots", "buckets", "graph_frames", "graphs", "attach_decoder", "attach_silence_s", "launch_ahead_streams", "step_frames", "stall_exit_s", "priority_first_chunks", "slot_codebooks", "max_batch_streams", "batch_mode", "seed", "torch_threads", "switch_interval_ms", "grace")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_CACHE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FRAMES_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    ATTACH_DECODER_FIELD_NUMBER: _ClassVar[int]
    ATTACH_SILENCE_S_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_AHEAD_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    STALL_EXIT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIRST_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SLOT_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_STREAMS_FIELD_NUMBER: _ClassVar[int]
    BATCH_MODE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TORCH_THREADS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    metrics_port: int
    codec: str
    preset: str
    device: str
    dtype: str
    first_chunk_frames: int
    chunk_frames: int
    encode_cache_size: int
    engine: str
    slots: int
    buckets: str
    graph_frames: str
    graphs: str
    attach_decoder: str
    attach_silence_s: float
    launch_ahead_streams: int
    step_frames: int
    stall_exit_s: float
    priority_first_chunks: bool
    slot_codebooks: int
    max_batch_streams: int
    batch_mode: str
    seed: int
    torch_threads: int
    switch_interval_ms: float
    grace: float
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., metrics_port: _Optional[int] = ..., codec: _Optional[str] = ..., preset: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., encode_cache_size: _Optional[int] = ..., engine: _Optional[str] = ..., slots: _Optional[int] = ..., buckets: _Optional[str] = ..., graph_frames: _Optional[str] = ..., graphs: _Optional[str] = ..., attach_decoder: _Optional[str] = ..., attach_silence_s: _Optional[float] = ..., launch_ahead_streams: _Optional[int] = ..., step_frames: _Optional[int] = ..., stall_exit_s: _Optional[float] = ..., priority_first_chunks: _Optional[bool] = ..., slot_codebooks: _Optional[int] = ..., max_batch_streams: _Optional[int] = ..., batch_mode: _Optional[str] = ..., seed: _Optional[int] = ..., torch_threads: _Optional[int] = ..., switch_interval_ms: _Optional[float] = ..., grace: _Optional[float] = ...) -> None: ...

class SchedulerConfig(_message.Message):
    __slots__ = ("max_queue", "max_running", "prefill_chunk", "page_size", "radix_cache", "lookahead", "lookahead_depth", "lookahead_max_batch", "prefill_interval", "loaded_prefill_interval", "loaded_batch", "cache_key", "step_timeout", "worker_probe", "restart_wait", "host", "port", "metrics_port", "worker", "vocoder", "tokenizer", "max_text_chars", "max_frames", "max_request_bytes", "max_language_chars", "max_instructions_chars", "max_request_id_chars", "max_id_chars", "max_references", "max_reference_seconds", "max_voices", "first_chunk_frames_loaded", "frontends", "drain_seconds", "omnivoice_worker", "omnivoice_vocoder", "omnivoice_tokenizer", "default_model")
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RADIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LOADED_PREFILL_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LOADED_BATCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    WORKER_PROBE_FIELD_NUMBER: _ClassVar[int]
    RESTART_WAIT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VOCODER_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LANGUAGE_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_INSTRUCTIONS_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_VOICES_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_LOADED_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OMNIVOICE_WORKER_FIELD_NUMBER: _ClassVar[int]
    OMNIVOICE_VOCODER_FIELD_NUMBER: _ClassVar[int]
    OMNIVOICE_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODEL_FIELD_NUMBER: _ClassVar[int]
    max_queue: int
    max_running: int
    prefill_chunk: int
    page_size: int
    radix_cache: bool
    lookahead: bool
    lookahead_depth: int
    lookahead_max_batch: int
    prefill_interval: int
    loaded_prefill_interval: int
    loaded_batch: int
    cache_key: str
    step_timeout: float
    worker_probe: float
    restart_wait: float
    host: str
    port: int
    metrics_port: int
    worker: str
    vocoder: _containers.RepeatedScalarFieldContainer[str]
    tokenizer: str
    max_text_chars: int
    max_frames: int
    max_request_bytes: int
    max_language_chars: int
    max_instructions_chars: int
    max_request_id_chars: int
    max_id_chars: int
    max_references: int
    max_reference_seconds: float
    max_voices: int
    first_chunk_frames_loaded: int
    frontends: int
    drain_seconds: float
    omnivoice_worker: _containers.RepeatedScalarFieldContainer[str]
    omnivoice_vocoder: _containers.RepeatedScalarFieldContainer[str]
    omnivoice_tokenizer: str
    default_model: str
    def __init__(self, max_queue: _Optional[int] = ..., max_running: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., page_size: _Optional[int] = ..., radix_cache: _Optional[bool] = ..., lookahead: _Optional[bool] = ..., lookahead_depth: _Optional[int] = ..., lookahead_max_batch: _Optional[int] = ..., prefill_interval: _Optional[int] = ..., loaded_prefill_interval: _Optional[int] = ..., loaded_batch: _Optional[int] = ..., cache_key: _Optional[str] = ..., step_timeout: _Optional[float] = ..., worker_probe: _Optional[float] = ..., restart_wait: _Optional[float] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., metrics_port: _Optional[int] = ..., worker: _Optional[str] = ..., vocoder: _Optional[_Iterable[str]] = ..., tokenizer: _Optional[str] = ..., max_text_chars: _Optional[int] = ..., max_frames: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_language_chars: _Optional[int] = ..., max_instructions_chars: _Optional[int] = ..., max_request_id_chars: _Optional[int] = ..., max_id_chars: _Optional[int] = ..., max_references: _Optional[int] = ..., max_reference_seconds: _Optional[float] = ..., max_voices: _Optional[int] = ..., first_chunk_frames_loaded: _Optional[int] = ..., frontends: _Optional[int] = ..., drain_seconds: _Optional[float] = ..., omnivoice_worker: _Optional[_Iterable[str]] = ..., omnivoice_vocoder: _Optional[_Iterable[str]] = ..., omnivoice_tokenizer: _Optional[str] = ..., default_model: _Optional[str] = ...) -> None: ...

class GatewayConfig(_message.Message):
    __slots__ = ("host", "port", "scheduler", "max_body_bytes", "retry_after", "mp3_bitrate_kbps", "voice_name_cache", "drain_seconds", "log_level")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    MAX_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    MP3_BITRATE_KBPS_FIELD_NUMBER: _ClassVar[int]
    VOICE_NAME_CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    scheduler: str
    max_body_bytes: int
    retry_after: int
    mp3_bitrate_kbps: int
    voice_name_cache: float
    drain_seconds: float
    log_level: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., scheduler: _Optional[str] = ..., max_body_bytes: _Optional[int] = ..., retry_after: _Optional[int] = ..., mp3_bitrate_kbps: _Optional[int] = ..., voice_name_cache: _Optional[float] = ..., drain_seconds: _Optional[float] = ..., log_level: _Optional[str] = ...) -> None: ...

class WorkerProcessConfig(_message.Message):
    __slots__ = ("worker", "vocoder")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VOCODER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerConfig
    vocoder: VocoderConfig
    def __init__(self, worker: _Optional[_Union[WorkerConfig, _Mapping]] = ..., vocoder: _Optional[_Union[VocoderConfig, _Mapping]] = ...) -> None: ...

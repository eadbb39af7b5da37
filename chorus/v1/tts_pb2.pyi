from chorus.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FORMAT_UNSPECIFIED: _ClassVar[OutputFormat]
    PCM16: _ClassVar[OutputFormat]
    FLOAT32: _ClassVar[OutputFormat]
    WAV: _ClassVar[OutputFormat]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    MAX_FRAMES: _ClassVar[FinishReason]

class StreamSignal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_SIGNAL_UNSPECIFIED: _ClassVar[StreamSignal]
    FLUSH: _ClassVar[StreamSignal]
    END: _ClassVar[StreamSignal]
    CANCEL: _ClassVar[StreamSignal]
OUTPUT_FORMAT_UNSPECIFIED: OutputFormat
PCM16: OutputFormat
FLOAT32: OutputFormat
WAV: OutputFormat
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
MAX_FRAMES: FinishReason
STREAM_SIGNAL_UNSPECIFIED: StreamSignal
FLUSH: StreamSignal
END: StreamSignal
CANCEL: StreamSignal

class VoiceReference(_message.Message):
    __slots__ = ("audio", "codes", "voice_id", "transcript")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    audio: _common_pb2.AudioData
    codes: _common_pb2.IntMatrix
    voice_id: str
    transcript: str
    def __init__(self, audio: _Optional[_Union[_common_pb2.AudioData, _Mapping]] = ..., codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., voice_id: _Optional[str] = ..., transcript: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "text_temperature", "text_top_p", "text_top_k", "audio_temperature", "audio_top_p", "audio_top_k", "audio_repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEXT_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOP_P_FIELD_NUMBER: _ClassVar[int]
    TEXT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOP_P_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOP_K_FIELD_NUMBER: _ClassVar[int]
    AUDIO_REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    text_temperature: float
    text_top_p: float
    text_top_k: int
    audio_temperature: float
    audio_top_p: float
    audio_top_k: int
    audio_repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., text_temperature: _Optional[float] = ..., text_top_p: _Optional[float] = ..., text_top_k: _Optional[int] = ..., audio_temperature: _Optional[float] = ..., audio_top_p: _Optional[float] = ..., audio_top_k: _Optional[int] = ..., audio_repetition_penalty: _Optional[float] = ...) -> None: ...

class StreamingPolicy(_message.Message):
    __slots__ = ("first_chunk_frames", "chunk_frames")
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    first_chunk_frames: int
    chunk_frames: int
    def __init__(self, first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "model", "language", "instructions", "references", "continuation", "sampling", "max_frames", "min_frames", "duration_frames", "format", "sample_rate", "streaming", "return_codes", "request_id", "duration_seconds", "auto_duration", "omnivoice")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DURATION_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    RETURN_CODES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AUTO_DURATION_FIELD_NUMBER: _ClassVar[int]
    OMNIVOICE_FIELD_NUMBER: _ClassVar[int]
    text: str
    model: str
    language: str
    instructions: str
    references: _containers.RepeatedCompositeFieldContainer[VoiceReference]
    continuation: VoiceReference
    sampling: SamplingParams
    max_frames: int
    min_frames: int
    duration_frames: int
    format: OutputFormat
    sample_rate: int
    streaming: StreamingPolicy
    return_codes: bool
    request_id: str
    duration_seconds: float
    auto_duration: bool
    omnivoice: OmniVoiceParams
    def __init__(self, text: _Optional[str] = ..., model: _Optional[str] = ..., language: _Optional[str] = ..., instructions: _Optional[str] = ..., references: _Optional[_Iterable[_Union[VoiceReference, _Mapping]]] = ..., continuation: _Optional[_Union[VoiceReference, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., duration_frames: _Optional[int] = ..., format: _Optional[_Union[OutputFormat, str]] = ..., sample_rate: _Optional[int] = ..., streaming: _Optional[_Union[StreamingPolicy, _Mapping]] = ..., return_codes: _Optional[bool] = ..., request_id: _Optional[str] = ..., duration_seconds: _Optional[float] = ..., auto_duration: _Optional[bool] = ..., omnivoice: _Optional[_Union[OmniVoiceParams, _Mapping]] = ...) -> None: ...

class OmniVoiceParams(_message.Message):
    __slots__ = ("num_step", "guidance_scale", "t_shift", "layer_penalty_factor", "position_temperature", "class_temperature", "speed", "denoise", "postprocess")
    NUM_STEP_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    T_SHIFT_FIELD_NUMBER: _ClassVar[int]
    LAYER_PENALTY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    POSITION_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CLASS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    DENOISE_FIELD_NUMBER: _ClassVar[int]
    POSTPROCESS_FIELD_NUMBER: _ClassVar[int]
    num_step: int
    guidance_scale: float
    t_shift: float
    layer_penalty_factor: float
    position_temperature: float
    class_temperature: float
    speed: float
    denoise: bool
    postprocess: bool
    def __init__(self, num_step: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., t_shift: _Optional[float] = ..., layer_penalty_factor: _Optional[float] = ..., position_temperature: _Optional[float] = ..., class_temperature: _Optional[float] = ..., speed: _Optional[float] = ..., denoise: _Optional[bool] = ..., postprocess: _Optional[bool] = ...) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("request_id", "model", "sample_rate", "channels", "format", "samples_per_frame")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    sample_rate: int
    channels: int
    format: OutputFormat
    samples_per_frame: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., format: _Optional[_Union[OutputFormat, str]] = ..., samples_per_frame: _Optional[int] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("data", "first_sample", "num_samples")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    first_sample: int
    num_samples: int
    def __init__(self, data: _Optional[bytes] = ..., first_sample: _Optional[int] = ..., num_samples: _Optional[int] = ...) -> None: ...

class CodesChunk(_message.Message):
    __slots__ = ("first_frame", "codes")
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    first_frame: int
    codes: _common_pb2.IntMatrix
    def __init__(self, first_frame: _Optional[int] = ..., codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ...) -> None: ...

class SynthesisSummary(_message.Message):
    __slots__ = ("frames", "audio_seconds", "finish_reason", "queue_ms", "first_audio_ms", "total_ms", "prompt_rows", "cached_prompt_rows", "first_frame_ms", "first_chunk_frames_ms", "last_frame_ms", "max_audio_lag_ms")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_AUDIO_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_FRAME_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    frames: int
    audio_seconds: float
    finish_reason: FinishReason
    queue_ms: float
    first_audio_ms: float
    total_ms: float
    prompt_rows: int
    cached_prompt_rows: int
    first_frame_ms: float
    first_chunk_frames_ms: float
    last_frame_ms: float
    max_audio_lag_ms: float
    def __init__(self, frames: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., queue_ms: _Optional[float] = ..., first_audio_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., prompt_rows: _Optional[int] = ..., cached_prompt_rows: _Optional[int] = ..., first_frame_ms: _Optional[float] = ..., first_chunk_frames_ms: _Optional[float] = ..., last_frame_ms: _Optional[float] = ..., max_audio_lag_ms: _Optional[float] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("header", "audio", "codes", "summary", "sentence")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SENTENCE_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    audio: AudioChunk
    codes: CodesChunk
    summary: SynthesisSummary
    sentence: SentenceMark
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., codes: _Optional[_Union[CodesChunk, _Mapping]] = ..., summary: _Optional[_Union[SynthesisSummary, _Mapping]] = ..., sentence: _Optional[_Union[SentenceMark, _Mapping]] = ...) -> None: ...

class SynthesizeStreamRequest(_message.Message):
    __slots__ = ("config", "text", "signal")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    config: SynthesizeRequest
    text: str
    signal: StreamSignal
    def __init__(self, config: _Optional[_Union[SynthesizeRequest, _Mapping]] = ..., text: _Optional[str] = ..., signal: _Optional[_Union[StreamSignal, str]] = ...) -> None: ...

class SentenceMark(_message.Message):
    __slots__ = ("index", "text", "first_sample")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    first_sample: int
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., first_sample: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "sample_rate", "channels", "frame_rate", "codebooks", "max_frames", "is_default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    sample_rate: int
    channels: int
    frame_rate: float
    codebooks: int
    max_frames: int
    is_default: bool
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., frame_rate: _Optional[float] = ..., codebooks: _Optional[int] = ..., max_frames: _Optional[int] = ..., is_default: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class CreateVoiceRequest(_message.Message):
    __slots__ = ("voice_id", "audio", "transcript", "model")
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    voice_id: str
    audio: _common_pb2.AudioData
    transcript: str
    model: str
    def __init__(self, voice_id: _Optional[str] = ..., audio: _Optional[_Union[_common_pb2.AudioData, _Mapping]] = ..., transcript: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class Voice(_message.Message):
    __slots__ = ("voice_id", "frames", "transcript", "model", "created_at")
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    voice_id: str
    frames: int
    transcript: str
    model: str
    created_at: int
    def __init__(self, voice_id: _Optional[str] = ..., frames: _Optional[int] = ..., transcript: _Optional[str] = ..., model: _Optional[str] = ..., created_at: _Optional[int] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("voice_id",)
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    voice_id: str
    def __init__(self, voice_id: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

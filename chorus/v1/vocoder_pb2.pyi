from chorus.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PcmEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PCM_FLOAT32: _ClassVar[PcmEncoding]
    PCM_INT16: _ClassVar[PcmEncoding]
PCM_FLOAT32: PcmEncoding
PCM_INT16: PcmEncoding

class DecodeStart(_message.Message):
    __slots__ = ("stream_id", "first_chunk_frames", "chunk_frames", "codebooks", "pcm_encoding")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    PCM_ENCODING_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    first_chunk_frames: int
    chunk_frames: int
    codebooks: int
    pcm_encoding: PcmEncoding
    def __init__(self, stream_id: _Optional[str] = ..., first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., codebooks: _Optional[int] = ..., pcm_encoding: _Optional[_Union[PcmEncoding, str]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("start", "frames", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    frames: _common_pb2.IntMatrix
    end: bool
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., frames: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("first_sample", "num_samples", "pcm", "first_frame", "frames", "pcm_encoding")
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PCM_ENCODING_FIELD_NUMBER: _ClassVar[int]
    first_sample: int
    num_samples: int
    pcm: bytes
    first_frame: int
    frames: int
    pcm_encoding: PcmEncoding
    def __init__(self, first_sample: _Optional[int] = ..., num_samples: _Optional[int] = ..., pcm: _Optional[bytes] = ..., first_frame: _Optional[int] = ..., frames: _Optional[int] = ..., pcm_encoding: _Optional[_Union[PcmEncoding, str]] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("audio", "codebooks")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    audio: _common_pb2.AudioData
    codebooks: int
    def __init__(self, audio: _Optional[_Union[_common_pb2.AudioData, _Mapping]] = ..., codebooks: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("codes", "cache_hit", "rms")
    CODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    RMS_FIELD_NUMBER: _ClassVar[int]
    codes: _common_pb2.IntMatrix
    cache_hit: bool
    rms: float
    def __init__(self, codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., cache_hit: _Optional[bool] = ..., rms: _Optional[float] = ...) -> None: ...

class DecodeClipRequest(_message.Message):
    __slots__ = ("codes", "pcm_encoding", "postprocess", "reference_rms", "fade_seconds", "pad_seconds", "continues", "continued")
    CODES_FIELD_NUMBER: _ClassVar[int]
    PCM_ENCODING_FIELD_NUMBER: _ClassVar[int]
    POSTPROCESS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_RMS_FIELD_NUMBER: _ClassVar[int]
    FADE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    codes: _common_pb2.IntMatrix
    pcm_encoding: PcmEncoding
    postprocess: bool
    reference_rms: float
    fade_seconds: float
    pad_seconds: float
    continues: bool
    continued: bool
    def __init__(self, codes: _Optional[_Union[_common_pb2.IntMatrix, _Mapping]] = ..., pcm_encoding: _Optional[_Union[PcmEncoding, str]] = ..., postprocess: _Optional[bool] = ..., reference_rms: _Optional[float] = ..., fade_seconds: _Optional[float] = ..., pad_seconds: _Optional[float] = ..., continues: _Optional[bool] = ..., continued: _Optional[bool] = ...) -> None: ...

class DecodeClipResponse(_message.Message):
    __slots__ = ("pcm", "num_samples", "pcm_encoding")
    PCM_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PCM_ENCODING_FIELD_NUMBER: _ClassVar[int]
    pcm: bytes
    num_samples: int
    pcm_encoding: PcmEncoding
    def __init__(self, pcm: _Optional[bytes] = ..., num_samples: _Optional[int] = ..., pcm_encoding: _Optional[_Union[PcmEncoding, str]] = ...) -> None: ...

class VocoderInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VocoderInfo(_message.Message):
    __slots__ = ("codec", "sample_rate", "channels", "samples_per_frame", "max_codebooks", "active_streams", "first_chunk_frames", "chunk_frames", "step_frames", "graph_frames", "slots")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    STEP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    codec: str
    sample_rate: int
    channels: int
    samples_per_frame: int
    max_codebooks: int
    active_streams: int
    first_chunk_frames: int
    chunk_frames: int
    step_frames: int
    graph_frames: _containers.RepeatedScalarFieldContainer[int]
    slots: int
    def __init__(self, codec: _Optional[str] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., samples_per_frame: _Optional[int] = ..., max_codebooks: _Optional[int] = ..., active_streams: _Optional[int] = ..., first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., step_frames: _Optional[int] = ..., graph_frames: _Optional[_Iterable[int]] = ..., slots: _Optional[int] = ...) -> None: ...

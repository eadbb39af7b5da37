from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_CONTAINER: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_PCM16: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_FLOAT32: _ClassVar[AudioEncoding]
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
AUDIO_ENCODING_CONTAINER: AudioEncoding
AUDIO_ENCODING_PCM16: AudioEncoding
AUDIO_ENCODING_FLOAT32: AudioEncoding

class IntMatrix(_message.Message):
    __slots__ = ("rows", "cols", "data")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    data: bytes
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AudioData(_message.Message):
    __slots__ = ("data", "encoding", "sample_rate", "channels")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    encoding: AudioEncoding
    sample_rate: int
    channels: int
    def __init__(self, data: _Optional[bytes] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ...) -> None: ...

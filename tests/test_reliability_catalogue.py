"""The bad-input catalogue: one table of the kinds of bad input tried against every public RPC
(TextToSpeech for both models, both vocoders, the HTTP gateway) on one cluster of the real
services (tiny models, CPU). Each row names the call, the request (a message, raw bytes, a
Decode stream or an HTTP call), the status it must end with and the field its message must
name; no message may echo more than a short prefix of what the client sent. After the table
the service still serves, every gauge is back at its baseline, and a seeded request gives the
same bytes as before it. README.md's reliability table quotes len(CATALOGUE)."""

from __future__ import annotations

import base64
import io
import math
import os
import re
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chorus.client import channel, synthesize
from chorus.processes import Service
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2
from gpu_worker.config import WorkerConfig
from helpers import make_cluster, seeded_request, wait_until_idle
from test_omnivoice_api import BAD as OMNIVOICE_BAD
from vocoder_svc.config import VocoderConfig

MAX_REQUEST_BYTES = 2 << 20
MAX_REFERENCE_S = 2  # 25 frames at 12.5 Hz
MAX_VOICES = 3
MAX_BODY = 256 << 10  # the gateway's
BIG = 1_000_000  # characters: under the request size limit, far over every string limit
LONG_ID = "v" * 17_000  # an id longer than a client's default metadata limit allows echoing
MAX_DETAILS = 300  # characters: a message names the field and the limit, and quotes 32 at most
MAX_HTTP_MESSAGE = 600  # the gateway's may list the fields it knows
OMNIVOICE = "omnivoice-tiny"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
SERVICE = "/chorus.v1.TextToSpeech/"
README = Path(__file__).resolve().parents[1] / "README.md"


@dataclass(frozen=True)
class Row:
    name: str
    rpc: str  # a TextToSpeech method, "Vocoder.<method>" (MOSS codec), "ClipVocoder.<method>", or "HTTP"
    request: object  # message or raw bytes; a Decode call's list of messages; HTTP: (method, path, httpx kwargs)
    code: object  # grpc.StatusCode, or the HTTP status
    field: str  # what the message must contain (HTTP: the error's param, else its message)


# ---- request builders --------------------------------------------------------------------------

def wav(seconds: float, rate: int = 16000, amplitude: float = 0.3) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, amplitude * np.sin(2 * np.pi * 220 * t), rate, format="WAV")
    return buf.getvalue()


def pcm16(samples: int, rate: int = 16000) -> common_pb2.AudioData:
    return common_pb2.AudioData(data=bytes(2 * samples), encoding=common_pb2.AUDIO_ENCODING_PCM16,
                                sample_rate=rate, channels=1)


def codes(rows: int, cols: int = 12, value: int = 0) -> common_pb2.IntMatrix:
    return common_pb2.IntMatrix(rows=rows, cols=cols, data=np.full(rows * cols, value, "<i4").tobytes())


def ref(**kw) -> tts_pb2.VoiceReference:
    return tts_pb2.VoiceReference(**kw)


def synth(**fields) -> tts_pb2.SynthesizeRequest:
    sampling = fields.pop("sampling", None)
    base = dict(text="Fine text.", max_frames=0 if fields.get("model") == OMNIVOICE else 4)
    base.update(fields)
    req = tts_pb2.SynthesizeRequest(**base)
    for k, v in (sampling or {}).items():
        setattr(req.sampling, k, v)
    return req


def raw(message) -> bytes:
    return message.SerializeToString()


def with_bad_utf8(message_bytes: bytes, marker: bytes) -> bytes:
    """The bytes with a same-length invalid UTF-8 sequence where `marker` was."""
    assert marker in message_bytes
    return message_bytes.replace(marker, b"\xff" * len(marker))


def voice(**kw) -> tts_pb2.CreateVoiceRequest:
    kw.setdefault("audio", common_pb2.AudioData(data=wav(1.0)))
    return tts_pb2.CreateVoiceRequest(**kw)


def start(**kw) -> vocoder_pb2.DecodeRequest:
    kw.setdefault("codebooks", 12)
    kw.setdefault("stream_id", "catalogue")
    return vocoder_pb2.DecodeRequest(start=vocoder_pb2.DecodeStart(**kw))


def frames(m: common_pb2.IntMatrix) -> vocoder_pb2.DecodeRequest:
    return vocoder_pb2.DecodeRequest(frames=m)


def clip(m: common_pb2.IntMatrix | None = None, **kw) -> vocoder_pb2.DecodeClipRequest:
    return vocoder_pb2.DecodeClipRequest(codes=codes(3, 8) if m is None else m, **kw)


def speech(**kw) -> tuple:
    body = {"model": "tts-1", "input": "Hello from the catalogue.", "voice": "alloy", "seed": 7, "max_frames": 4,
            **kw}
    return ("POST", "/v1/audio/speech", {"json": {k: v for k, v in body.items() if v is not None}})


# ---- the catalogue -----------------------------------------------------------------------------

def _tts_rows() -> list[Row]:
    S, C = "Synthesize", "CreateVoice"
    return [
        # every string's length
        Row("text over the long-form limit", S, synth(text="x" * 60_000), INVALID, "text"),
        Row("text empty", S, synth(text=""), INVALID, "text"),
        Row("text only whitespace", S, synth(text="   \n\t"), INVALID, "text"),
        Row("language over 64", S, synth(language="E" * 65), INVALID, "language"),
        Row("language 1 MB", S, synth(language="x" * BIG), INVALID, "language"),
        Row("instructions over 1000", S, synth(instructions="i" * 1001), INVALID, "instructions"),
        Row("instructions 1 MB", S, synth(instructions="i" * BIG), INVALID, "instructions"),
        Row("request_id over 128", S, synth(request_id="r" * 129), INVALID, "request_id"),
        Row("request_id 1 MB", S, synth(request_id="r" * BIG), INVALID, "request_id"),
        Row("model over 128", S, synth(model="m" * 129), INVALID, "model"),
        Row("model 17 KB", S, synth(model="m" * 17_000), INVALID, "model"),
        Row("model unknown", S, synth(model="no-such-model-" + "z" * 100), INVALID, "model"),
        # frames and duration hints
        Row("max_frames negative", S, synth(max_frames=-1), INVALID, "max_frames"),
        Row("max_frames over the limit", S, synth(max_frames=100_000), INVALID, "max_frames"),
        Row("min_frames over max_frames", S, synth(min_frames=20, max_frames=10), INVALID, "min_frames"),
        Row("min_frames negative", S, synth(min_frames=-5), INVALID, "min_frames"),
        Row("duration_frames negative", S, synth(duration_frames=-2), INVALID, "duration_frames"),
        Row("duration_frames over the limit", S, synth(duration_frames=1 << 30), INVALID, "duration_frames"),
        Row("duration_seconds nan", S, synth(duration_seconds=math.nan), INVALID, "duration_seconds"),
        Row("duration_seconds negative", S, synth(duration_seconds=-3.0), INVALID, "duration_seconds"),
        Row("duration_seconds 1e30", S, synth(duration_seconds=1e30), INVALID, "duration_seconds"),
        Row("two duration hints", S, synth(duration_frames=20, auto_duration=True), INVALID, "duration_frames"),
        # sampling
        Row("temperature nan", S, synth(sampling={"temperature": math.nan}), INVALID, "temperature"),
        Row("temperature negative", S, synth(sampling={"temperature": -1}), INVALID, "temperature"),
        Row("temperature inf", S, synth(sampling={"temperature": math.inf}), INVALID, "temperature"),
        Row("temperature over 100", S, synth(sampling={"temperature": 101}), INVALID, "temperature"),
        Row("top_p 0", S, synth(sampling={"top_p": 0}), INVALID, "top_p"),
        Row("top_p over 1", S, synth(sampling={"top_p": 1.5}), INVALID, "top_p"),
        Row("top_k under -1", S, synth(sampling={"top_k": -2}), INVALID, "top_k"),
        Row("audio_top_k under -1", S, synth(sampling={"audio_top_k": -5}), INVALID, "audio_top_k"),
        Row("text_top_p 0", S, synth(sampling={"text_top_p": 0}), INVALID, "text_top_p"),
        Row("text_temperature nan", S, synth(sampling={"text_temperature": math.nan}), INVALID,
            "text_temperature"),
        Row("repetition_penalty 0", S, synth(sampling={"repetition_penalty": 0}), INVALID, "repetition_penalty"),
        Row("audio_repetition_penalty over 100", S, synth(sampling={"audio_repetition_penalty": 101}), INVALID,
            "audio_repetition_penalty"),
        # output and streaming
        Row("format unknown", S, synth(format=9), INVALID, "format"),
        Row("sample_rate too low", S, synth(sample_rate=100), INVALID, "sample_rate"),
        Row("sample_rate too high", S, synth(sample_rate=400_000), INVALID, "sample_rate"),
        Row("sample_rate negative", S, synth(sample_rate=-8000), INVALID, "sample_rate"),
        Row("first_chunk_frames negative", S, synth(streaming=tts_pb2.StreamingPolicy(first_chunk_frames=-1)),
            INVALID, "streaming.first_chunk_frames"),
        Row("chunk_frames over 250", S, synth(streaming=tts_pb2.StreamingPolicy(chunk_frames=251)), INVALID,
            "streaming.chunk_frames"),
        Row("OmniVoice knobs on a MOSS request", S, synth(omnivoice=tts_pb2.OmniVoiceParams(speed=1.5)), INVALID,
            "omnivoice"),
        # references
        Row("reference voice_id 17 KB", S, synth(references=[ref(voice_id=LONG_ID)]), INVALID,
            "references[0].voice_id"),
        Row("reference voice_id unknown", S, synth(references=[ref(voice_id="nobody-" + "n" * 100)]), NOT_FOUND,
            "references[0].voice_id"),
        Row("reference transcript over the limit", S, synth(references=[ref(voice_id="a", transcript="t" * 6000)]),
            INVALID, "references[0].transcript"),
        Row("too many references", S, synth(references=[ref(codes=codes(2))] * 9), INVALID, "references"),
        Row("reference without a source", S, synth(references=[ref(transcript="hello")]), INVALID,
            "references[0]"),
        Row("reference codes too long", S, synth(references=[ref(codes=codes(26))]), INVALID,
            "references[0].codes"),
        Row("reference codes row count lies", S, synth(references=[ref(codes=common_pb2.IntMatrix(
            rows=3, cols=12, data=bytes(8)))]), INVALID, "references[0].codes"),
        Row("reference codes of 5 columns", S, synth(references=[ref(codes=codes(2, 5))]), INVALID,
            "references[0].codes"),
        Row("reference codes of 0 frames", S, synth(references=[ref(codes=codes(0))]), INVALID,
            "references[0].codes"),
        Row("reference code out of the vocabulary", S, synth(references=[ref(codes=codes(2, value=1 << 20))]),
            INVALID, "references[0].codes"),
        Row("reference code negative", S, synth(references=[ref(codes=codes(2, value=-7))]), INVALID,
            "references[0].codes"),
        Row("reference raw audio too long", S, synth(references=[ref(audio=pcm16(3 * 16000))]), INVALID,
            "references[0].audio"),
        Row("reference WAV too long", S, synth(references=[ref(codes=codes(2)), ref(
            audio=common_pb2.AudioData(data=wav(3.0)))]), INVALID, "references[1].audio"),
        Row("reference of one sample", S, synth(references=[ref(audio=pcm16(1))]), INVALID, "references[0].audio"),
        Row("reference not audio", S, synth(references=[ref(audio=common_pb2.AudioData(data=b"garbage"))]),
            INVALID, "references[0].audio"),
        Row("reference raw PCM without a rate", S, synth(references=[ref(audio=common_pb2.AudioData(
            data=bytes(3200), encoding=common_pb2.AUDIO_ENCODING_PCM16, channels=1))]), INVALID,
            "references[0].audio"),
        Row("reference raw PCM of odd bytes", S, synth(references=[ref(audio=common_pb2.AudioData(
            data=bytes(3201), encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=16000, channels=1))]), INVALID,
            "references[0].audio"),
        Row("reference audio encoding unknown", S, synth(references=[ref(audio=common_pb2.AudioData(
            data=bytes(64), encoding=77, sample_rate=16000, channels=1))]), INVALID, "references[0].audio"),
        # continuation
        Row("continuation transcript over the limit", S, synth(continuation=ref(
            codes=codes(2), transcript="t" * 6000)), INVALID, "continuation.transcript"),
        Row("continuation without a transcript", S, synth(continuation=ref(codes=codes(2))), INVALID,
            "continuation.transcript"),
        Row("continuation and references", S, synth(continuation=ref(codes=codes(2), transcript="hi"),
                                                    references=[ref(codes=codes(2))]), INVALID, "continuation"),
        Row("continuation voice_id 17 KB", S, synth(continuation=ref(voice_id=LONG_ID, transcript="hi")),
            INVALID, "continuation.voice_id"),
        Row("continuation voice_id unknown", S, synth(continuation=ref(voice_id="x" * 128, transcript="hi")),
            NOT_FOUND, "continuation.voice_id"),
        Row("continuation WAV too long", S, synth(continuation=ref(audio=common_pb2.AudioData(data=wav(3.0)),
                                                                   transcript="hi")),
            INVALID, "continuation.audio"),
        # bytes that do not decode
        Row("text not UTF-8", S, with_bad_utf8(raw(synth(text="Fine QQQQ.")), b"QQQQ"), INVALID, "text"),
        Row("language not UTF-8", S, with_bad_utf8(raw(synth(language="QQQQ")), b"QQQQ"), INVALID, "language"),
        Row("request_id not UTF-8", S, with_bad_utf8(raw(synth(request_id="QQQQ")), b"QQQQ"), INVALID,
            "request_id"),
        Row("nested transcript not UTF-8", S, with_bad_utf8(raw(synth(references=[
            ref(codes=codes(2)), ref(voice_id="a", transcript="QQQQ")])), b"QQQQ"), INVALID,
            "references[1].transcript"),
        Row("corrupt body", S, b"\xff\xff\xff\xff", INVALID, "request"),
        Row("truncated body", S, raw(synth(instructions="calm and slow"))[:-3], INVALID, "request"),
        Row("a length past the end of the body", S, b"\x0a\x7fab", INVALID, "request"),
        Row("body over the size limit", S, raw(synth(text="x" * (MAX_REQUEST_BYTES + 10))),
            grpc.StatusCode.RESOURCE_EXHAUSTED, str(MAX_REQUEST_BYTES)),
        # OmniVoice beyond its knobs (those come from test_omnivoice_api.BAD below)
        Row("OmniVoice language 1 MB", S, synth(model=OMNIVOICE, language="x" * BIG), INVALID, "language"),
        Row("OmniVoice request_id 1 MB", S, synth(model=OMNIVOICE, request_id="r" * BIG), INVALID, "request_id"),
        Row("OmniVoice reference voice_id unknown", S, synth(model=OMNIVOICE, references=[
            ref(voice_id="nobody")]), NOT_FOUND, "references[0].voice_id"),
        Row("OmniVoice reference WAV too long", S, synth(model=OMNIVOICE, references=[
            ref(audio=common_pb2.AudioData(data=wav(3.0)), transcript="Hi.")]), INVALID, "references[0].audio"),
        Row("OmniVoice reference codes of 12 columns", S, synth(model=OMNIVOICE, references=[
            ref(codes=codes(3, 12), transcript="Hi.")]), INVALID, "references[0].codes"),
        Row("OmniVoice text not UTF-8", S, with_bad_utf8(raw(synth(model=OMNIVOICE, text="ok QQQQ")),
                                                         b"QQQQ"), INVALID, "text"),
        # CreateVoice
        Row("voice_id over 128", C, voice(voice_id="v" * 129), INVALID, "voice_id"),
        Row("voice_id 17 KB", C, voice(voice_id=LONG_ID), INVALID, "voice_id"),
        Row("voice transcript over the limit", C, voice(transcript="t" * 6000), INVALID, "transcript"),
        Row("voice model over 128", C, voice(model="m" * 129), INVALID, "model"),
        Row("voice model unknown", C, voice(model="nope"), INVALID, "model"),
        Row("voice without audio", C, tts_pb2.CreateVoiceRequest(voice_id="a"), INVALID, "audio"),
        Row("voice of one sample", C, voice(voice_id="tiny", audio=pcm16(1)), INVALID, "audio"),
        Row("voice of one WAV sample", C, voice(voice_id="tiny", audio=common_pb2.AudioData(data=wav(1 / 16000))),
            INVALID, "audio"),
        Row("voice too long", C, voice(audio=common_pb2.AudioData(data=wav(3.0))), INVALID, "audio"),
        Row("voice not audio", C, voice(audio=common_pb2.AudioData(data=b"RIFF" + bytes(40))), INVALID, "audio"),
        Row("voice raw PCM of 65 channels", C, voice(audio=common_pb2.AudioData(
            data=bytes(130 * 1600), encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=16000, channels=65)),
            INVALID, "audio"),
        Row("voice raw PCM at 1 Hz", C, voice(audio=common_pb2.AudioData(
            data=bytes(2), encoding=common_pb2.AUDIO_ENCODING_PCM16, sample_rate=1, channels=1)), INVALID, "audio"),
        Row("voice float32 NaN samples", C, voice(audio=common_pb2.AudioData(
            data=np.full(16000, np.nan, "<f4").tobytes(), encoding=common_pb2.AUDIO_ENCODING_FLOAT32,
            sample_rate=16000, channels=1)), INVALID, "audio"),
        Row("OmniVoice voice too long", C, voice(model=OMNIVOICE, audio=common_pb2.AudioData(data=wav(3.0))),
            INVALID, "audio"),
        Row("OmniVoice voice of silence", C, voice(model=OMNIVOICE, audio=common_pb2.AudioData(
            data=wav(1.0, amplitude=0.0))), INVALID, "audio"),
        Row("OmniVoice voice not audio", C, voice(model=OMNIVOICE, audio=common_pb2.AudioData(data=b"garbage")),
            INVALID, "audio"),
        Row("voice_id not UTF-8", C, with_bad_utf8(raw(voice(voice_id="QQQQ")), b"QQQQ"), INVALID, "voice_id"),
        Row("voice corrupt body", C, b"\x12\xff\xff\xff\xff\x0f", INVALID, "request"),
        # DeleteVoice, ListVoices, ListModels
        Row("delete voice_id 17 KB", "DeleteVoice", tts_pb2.DeleteVoiceRequest(voice_id=LONG_ID), INVALID,
            "voice_id"),
        Row("delete voice_id unknown", "DeleteVoice", tts_pb2.DeleteVoiceRequest(voice_id="d" * 128), NOT_FOUND,
            "voice_id"),
        Row("delete voice_id empty", "DeleteVoice", tts_pb2.DeleteVoiceRequest(), NOT_FOUND, "voice_id"),
        Row("delete voice_id not UTF-8", "DeleteVoice", with_bad_utf8(raw(tts_pb2.DeleteVoiceRequest(
            voice_id="QQQQ")), b"QQQQ"), INVALID, "voice_id"),
        Row("list voices corrupt body", "ListVoices", b"\x0a\x05ab", INVALID, "request"),
        Row("list models corrupt body", "ListModels", b"\xff", INVALID, "request"),
    ]


def _omnivoice_rows() -> list[Row]:
    """test_omnivoice_api's table of bad OmniVoice knobs and MOSS-only fields, through the service."""
    return [Row(f"OmniVoice {name}", "Synthesize", req, INVALID, field) for name, (req, field) in OMNIVOICE_BAD.items()]


def _vocoder_rows() -> list[Row]:
    D, E, K = "Vocoder.Decode", "Vocoder.Encode", "ClipVocoder.DecodeClip"
    return [
        Row("decode frames before start", D, [frames(codes(2))], INVALID, "start"),
        Row("decode start twice", D, [start(), start()], INVALID, "start"),
        Row("decode empty message", D, [start(), vocoder_pb2.DecodeRequest()], INVALID, "DecodeRequest"),
        Row("decode nothing sent", D, [], INVALID, "start"),
        Row("decode 33 codebooks", D, [start(codebooks=33)], INVALID, "start.codebooks"),
        Row("decode negative codebooks", D, [start(codebooks=-1)], INVALID, "start.codebooks"),
        Row("decode negative chunk", D, [start(chunk_frames=-4)], INVALID, "start.chunk_frames"),
        Row("decode chunk over the limit", D, [start(chunk_frames=100_000)], INVALID, "start.chunk_frames"),
        Row("decode pcm_encoding unknown", D, [start(pcm_encoding=7)], INVALID, "start.pcm_encoding"),
        Row("decode frames of other columns", D, [start(), frames(codes(2, 8))], INVALID, "columns"),
        Row("decode frames row count lies", D, [start(), frames(common_pb2.IntMatrix(rows=4, cols=12, data=bytes(
            12)))], INVALID, "frames.data"),
        Row("decode negative rows", D, [start(), frames(common_pb2.IntMatrix(rows=-1, cols=12))], INVALID,
            "frames.rows"),
        Row("decode code out of range", D, [start(), frames(codes(2, value=4096))], INVALID, "frames: code"),
        Row("decode negative code", D, [start(), frames(codes(2, value=-1))], INVALID, "frames: code"),
        Row("decode corrupt message", D, [start(), b"\x12\xff\xff\xff"], INVALID, "request"),
        Row("decode stream_id not UTF-8", D, [with_bad_utf8(raw(start(stream_id="QQQQ")), b"QQQQ")], INVALID,
            "start.stream_id"),
        Row("encode not audio", E, vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=b"garbage")), INVALID,
            "audio"),
        Row("encode no audio", E, vocoder_pb2.EncodeRequest(), INVALID, "audio"),
        Row("encode 99 codebooks", E, vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=wav(0.5)),
                                                                codebooks=99), INVALID, "codebooks"),
        Row("encode corrupt body", E, b"\x0a\xff\xff\xff\xff\x0f", INVALID, "request"),
        Row("clip of 6 columns", K, clip(codes(3, 6)), INVALID, "codes"),
        Row("clip code out of range", K, clip(codes(3, 8, value=5000)), INVALID, "codes"),
        Row("clip of 0 frames", K, clip(codes(0, 8)), INVALID, "codes"),
        Row("clip data short", K, clip(common_pb2.IntMatrix(rows=2, cols=8, data=bytes(12))), INVALID, "codes"),
        Row("clip pcm_encoding unknown", K, clip(pcm_encoding=7), INVALID, "pcm_encoding"),
        Row("clip reference_rms negative", K, clip(reference_rms=-1), INVALID, "reference_rms"),
        Row("clip fade_seconds nan", K, clip(fade_seconds=math.nan), INVALID, "fade_seconds"),
        Row("clip pad_seconds 11", K, clip(pad_seconds=11), INVALID, "pad_seconds"),
        Row("clip on the MOSS codec", "Vocoder.DecodeClip", clip(), UNIMPLEMENTED, "DecodeClip"),
        Row("decode on the OmniVoice codec", "ClipVocoder.Decode", [start()], UNIMPLEMENTED, "Decode"),
    ]


def _http_rows() -> list[Row]:
    H = "HTTP"
    rows = [
        ("aac at a rate AAC lacks", speech(response_format="aac", sample_rate=44000), 400, "sample_rate"),
        ("response_format ogg", speech(response_format="ogg"), 400, "response_format"),
        ("stream_format unknown", speech(stream_format="chunks"), 400, "stream_format"),
        ("input missing", speech(input=None), 400, "input"),
        ("input empty", speech(input=""), 400, "input"),
        ("input a number", speech(input=5), 400, "input"),
        ("unknown field", speech(colour="blue"), 400, "colour"),
        ("unknown field of 17 KB", speech(**{LONG_ID: 1}), 400, "v" * 32 + "..."),
        ("temperature negative", speech(temperature=-1), 400, "temperature"),
        ("top_p over 1", speech(top_p=1.5), 400, "top_p"),
        ("seed negative", speech(seed=-3), 400, "seed"),
        ("max_frames 1e7", speech(max_frames=10 ** 7), 400, "max_frames"),
        ("max_frames 1e12", speech(max_frames=10 ** 12), 400, "max_frames"),
        ("seed 2^70", speech(seed=2 ** 70), 400, "seed"),
        ("chunk_frames 2^40", speech(chunk_frames=2 ** 40), 400, "chunk_frames"),
        ("top_k not whole", speech(top_k=2.5), 400, "top_k"),
        ("speed 2", speech(speed=2.0), 400, "speed"),
        ("speed 9", speech(speed=9.0), 400, "speed"),
        ("opus at 44.1 kHz", speech(response_format="opus", sample_rate=44100), 400, "sample_rate"),
        ("reference_audio not base64", speech(reference_audio="***"), 400, "reference_audio"),
        ("reference_audio not audio", speech(reference_audio=base64.b64encode(b"not audio").decode()), 400,
         "reference_audio"),
        ("model unknown", speech(model="no-such-model"), 404, "model"),
        ("voice unknown", speech(voice="nobody"), 404, "voice"),
        ("instructions 1 MB", speech(instructions="i" * 200_000), 400, "instructions"),
        ("speech body not JSON", ("POST", "/v1/audio/speech", {"content": b"{nope",
                                                               "headers": {"content-type": "application/json"}}),
         400, "JSON"),
        ("speech body too large", speech(input="x" * (MAX_BODY + 10)), 413, str(MAX_BODY)),
        ("voice upload too large", ("POST", "/v1/audio/voices", {"files": {
            "audio_sample": ("big.wav", bytes(MAX_BODY + 10), "audio/wav")}}), 413, str(MAX_BODY)),
        ("voice JSON audio not base64", ("POST", "/v1/audio/voices", {"json": {"audio": "***"}}), 400, "audio"),
        ("voice JSON unknown field", ("POST", "/v1/audio/voices", {"json": {"audio": "AAAA", "colour": "x"}}), 400,
         "colour"),
        ("voice JSON unknown field of 17 KB", ("POST", "/v1/audio/voices", {"json": {LONG_ID: "x"}}), 400,
         "v" * 32 + "..."),
        ("voice form without a file", ("POST", "/v1/audio/voices", {"data": {"name": "x"}, "files": {
            "other": ("a.txt", b"x", "text/plain")}}), 400, "audio_sample"),
        ("voice name 17 KB", ("POST", "/v1/audio/voices", {"json": {
            "audio": base64.b64encode(wav(0.5)).decode(), "name": LONG_ID}}), 400, "voice_id"),
        ("delete voice unknown", ("DELETE", "/v1/audio/voices/nobody-here", {}), 404, "voice_id"),
        ("unknown path", ("GET", "/v1/audio/nothing", {}), 404, "/v1/audio/nothing"),
        ("wrong method", ("PUT", "/v1/models", {}), 405, "PUT"),
    ]
    return [Row(f"HTTP {name}", H, request, status, field) for name, request, status, field in rows]


CATALOGUE = _tts_rows() + _omnivoice_rows() + _vocoder_rows() + _http_rows()


# ---- the cluster -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def service():
    """MOSS (tiny) and OmniVoice (tiny) behind one scheduler, with small limits, and a gateway."""
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "4096"],
                      scheduler_args=["--max-request-bytes", str(MAX_REQUEST_BYTES),
                                      "--max-reference-s", str(MAX_REFERENCE_S),
                                      "--max-voices", str(MAX_VOICES)],
                      omnivoice_worker=WorkerConfig(preset="omnivoice-tiny", dtype="float32"),
                      omnivoice_vocoder=VocoderConfig(preset="higgs-tiny")) as c:
        gateway = Service("gateway", [sys.executable, "-m", "gateway_svc.server", "--port", "0", "--scheduler",
                                      c.address, "--max-body-bytes", str(MAX_BODY)])
        gateway.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
        c.services.insert(0, gateway)  # the cluster stops it with the rest (its address stays the scheduler's)
        gateway.wait_ready(120)
        c.http = f"http://{gateway.address}"
        yield c


@pytest.fixture(scope="module")
def stub(service):
    return tts_pb2_grpc.TextToSpeechStub(channel(service.address))


def golden_requests() -> list[tts_pb2.SynthesizeRequest]:
    moss = seeded_request(seed=11, frames=6)
    omnivoice = tts_pb2.SynthesizeRequest(text="The same every time.", model=OMNIVOICE)
    omnivoice.omnivoice.num_step = 4
    omnivoice.sampling.seed = 11
    return [moss, omnivoice]


@pytest.fixture(scope="module")
def before(service, stub):
    """What the service gives for the golden requests before the catalogue runs."""
    return [synthesize(stub, r, timeout=300).audio_bytes for r in golden_requests()]


def labelled_sum(cluster, name: str) -> float:
    """A labelled metric of the core summed over its series (read_metrics keeps the unlabelled ones)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


# ---- calling a row -----------------------------------------------------------------------------

def _passthrough(ch: grpc.Channel, method: str, streaming: bool):
    make = ch.unary_stream if streaming else ch.unary_unary
    return make(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def _body(request) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def call_grpc(cluster, row: Row):
    """Makes the row's call; returns nothing or raises its grpc.RpcError."""
    if row.rpc.startswith(("Vocoder.", "ClipVocoder.")):
        service_name, method = row.rpc.split(".")
        address = cluster.service("vocoder" if service_name == "Vocoder" else "omnivoice-vocoder").address
        ch = channel(address)
        try:
            if method == "Decode":
                decode = ch.stream_stream("/chorus.v1.Vocoder/Decode", request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
                list(decode(iter([_body(m) for m in row.request]), timeout=60))
            else:
                _passthrough(ch, f"/chorus.v1.Vocoder/{method}", False)(_body(row.request), timeout=60)
        finally:
            ch.close()
        return
    ch = channel(cluster.address)
    try:
        call = _passthrough(ch, SERVICE + row.rpc, row.rpc == "Synthesize")
        out = call(_body(row.request), timeout=60)
        if row.rpc == "Synthesize":
            list(out)
    finally:
        ch.close()


def test_the_golden_requests_give_audio(before):
    assert all(len(audio) > 0 for audio in before)


@pytest.mark.parametrize("row", CATALOGUE, ids=[r.name for r in CATALOGUE])
def test_bad_input(service, before, row):
    if row.rpc == "HTTP":
        method, path, kwargs = row.request
        with httpx.Client(base_url=service.http, timeout=60) as client:
            resp = client.request(method, path, **kwargs)
        assert resp.status_code == row.code, resp.text[:MAX_DETAILS]
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
        assert row.field == err["param"] or row.field in err["message"], err
        assert len(err["message"]) < MAX_HTTP_MESSAGE and len(err["param"] or "") < 64, err["message"][:100]
        return
    with pytest.raises(grpc.RpcError) as e:
        call_grpc(service, row)
    details = e.value.details() or ""
    assert e.value.code() == row.code, f"{e.value.code()} {details[:MAX_DETAILS]}"
    assert row.field in details, details[:MAX_DETAILS]
    assert len(details) < MAX_DETAILS, f"{len(details)} characters"


def test_the_catalogue_is_broad_and_its_names_distinct():
    assert len(CATALOGUE) >= 100
    assert len({r.name for r in CATALOGUE}) == len(CATALOGUE)


def test_the_readme_quotes_the_catalogue_size():
    m = re.search(r"Kinds of bad input tried \| (\d+)", README.read_text())
    assert m, "README.md: the reliability table's 'Kinds of bad input tried' row is missing"
    assert int(m.group(1)) == len(CATALOGUE)


# ---- what the limits protect, beyond one call --------------------------------------------------

def test_no_zero_frame_voice_is_stored_and_the_service_still_serves(service, stub):
    voices = stub.ListVoices(tts_pb2.ListVoicesRequest()).voices
    assert all(v.frames > 0 for v in voices) and "tiny" not in [v.voice_id for v in voices]
    made = stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="ok", audio=common_pb2.AudioData(data=wav(1.0))))
    assert made.frames > 0
    req = seeded_request(frames=3, instructions="calm", request_id="r" * 128)
    req.references.add(voice_id="ok")
    out = synthesize(stub, req, timeout=120)
    assert out.summary.frames == 3 and out.header.request_id == "r" * 128
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="ok"))
    assert wait_until_idle(service) == (0, 0, 0, 0)


def test_a_request_id_cannot_forge_a_log_line(service, stub):
    out = synthesize(stub, seeded_request(frames=2, request_id="abc\nFORGED INFO all is well\x1b[2J"), timeout=120)
    assert out.summary.frames == 2
    lines = service.service("scheduler").lines
    assert not any(line.startswith("FORGED") for line in lines)
    assert any("abc\\nFORGED INFO all is well\\x1b[2J" in line for line in lines)


def test_the_voice_store_is_bounded(stub):
    audio = common_pb2.AudioData(data=wav(0.5))
    for i in range(MAX_VOICES):
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id=f"v{i}", audio=audio))
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="one-too-many", audio=audio))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "voice store" in e.value.details()
    assert str(MAX_VOICES) in e.value.details() and len(e.value.details()) < MAX_DETAILS
    with pytest.raises(grpc.RpcError) as e:  # an id in use is refused, full or not
        stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="v0", audio=audio))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "DeleteVoice" in e.value.details()
    assert sorted(v.voice_id for v in stub.ListVoices(tts_pb2.ListVoicesRequest()).voices) == ["v0", "v1", "v2"]
    for i in range(MAX_VOICES):
        stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id=f"v{i}"))
    stub.CreateVoice(tts_pb2.CreateVoiceRequest(voice_id="room-again", audio=audio))
    stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id="room-again"))


def test_the_request_decoder_never_raises_on_mutated_bytes():
    """Whatever the bytes, the servicer gets a message or an Undecodable naming what is wrong (an
    exception in the deserializer would reach the client as UNKNOWN)."""
    from chorus.request_decoding import Undecodable, deserializer
    decode = deserializer(tts_pb2.SynthesizeRequest)
    valid = bytearray(raw(synth(language="English", references=[ref(voice_id="v", transcript="hello")],
                                continuation=ref(codes=codes(2), transcript="said"))))
    rng = np.random.default_rng(0)
    for _ in range(3000):
        body = bytearray(valid)
        for i in rng.integers(0, len(body), size=int(rng.integers(1, 4))):
            body[i] = int(rng.integers(0, 256))
        out = decode(bytes(body[:int(rng.integers(0, len(body) + 1))]))
        assert isinstance(out, (tts_pb2.SynthesizeRequest, Undecodable))
        if isinstance(out, Undecodable):
            assert len(out.message) < MAX_DETAILS


def test_log_text_escapes_control_characters_and_is_capped():
    from scheduler_svc.validation import printable, shown
    assert printable("abc\ndef\x1b\t") == "abc\\ndef\\x1b\\t"
    assert len(printable("x" * 10_000)) == 128 and printable("plain-id_1") == "plain-id_1"
    assert shown("y" * 17_000) == repr("y" * 32) + "..."


# ---- after everything --------------------------------------------------------------------------

def test_afterwards_the_service_is_healthy_idle_and_gives_the_same_audio(service, stub, before):
    health = health_pb2_grpc.HealthStub(channel(service.address))
    for name in ("", "chorus.v1.TextToSpeech", f"chorus.v1.TextToSpeech/{OMNIVOICE}"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING, name
    assert wait_until_idle(service) == (0, 0, 0, 0)  # KV slots, running, worker states, vocoder streams
    for gauge in ("chorus_canvas_queue_depth", "chorus_canvas_running", "chorus_canvas_rows_used"):
        assert labelled_sum(service, gauge) == 0, gauge
    from chorus.processes import read_metrics
    m = read_metrics(service.metrics_port)
    assert m["chorus_queue_depth"] == 0 and m["chorus_running_requests"] == 0 and m["chorus_kv_slots_used"] == 0
    assert m["chorus_kv_slots_free"] + m["chorus_kv_slots_cached"] == m["chorus_kv_slots_total"]
    after = [synthesize(stub, r, timeout=300).audio_bytes for r in golden_requests()]
    assert after == before
    assert service.service("scheduler").proc.poll() is None and service.service("gateway").proc.poll() is None

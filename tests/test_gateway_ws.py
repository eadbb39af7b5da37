"""The gateway's WebSocket speech stream (/v1/audio/speech/stream) against the real services (tiny
model, CPU): its event sequence, each sentence continuing the previous one's audio as the gRPC API
would, the same audio however the text is split into pieces, cancel freeing everything, and bad
input answered with an error event naming the field and a close code. Then the sentence cutter
on its own (each sentence's request: tests/test_synthesize_stream.py)."""

from __future__ import annotations

import json
import random
import time

import pytest

from chorus.client import channel, synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc
from chorus.sentences import SentenceCutter, split_sentences
from helpers import metric, wait_until_idle
from test_gateway import FRAMES, SAMPLES_PER_FRAME, stack  # noqa: F401 - the module's services

websockets_sync = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed  # noqa: E402

TEXT = "Hello Mr. Smith. It costs 3.5 dollars today! Is that fair? 好的。Fine"
SENTENCE_BYTES = FRAMES * SAMPLES_PER_FRAME * 2 * 2  # int16 stereo


def config(**kw) -> dict:
    return {"model": "tts-1", "seed": 7, "min_frames": FRAMES, "max_frames": FRAMES, **kw}


class Session:
    """What one WebSocket session received: events (JSON), audio per sentence, the close code."""

    def __init__(self):
        self.events: list[dict] = []
        self.audio: dict[int, bytearray] = {}
        self.close_code: int | None = None

    @property
    def kinds(self) -> list[str]:
        return [e["type"] for e in self.events]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def pcm(self) -> bytes:
        return b"".join(self.audio[i] for i in sorted(self.audio))


def receive(ws, session: Session, until=None) -> Session:
    """Reads until the server closes (or until(message) is true)."""
    index = None
    try:
        while True:
            msg = ws.recv(timeout=120)
            if isinstance(msg, bytes):
                session.audio.setdefault(index, bytearray()).extend(msg)
            else:
                event = json.loads(msg)
                session.events.append(event)
                if event["type"] == "sentence":
                    index = event["index"]
            if until is not None and until(msg):
                return session
    except ConnectionClosed as e:
        session.close_code = e.rcvd.code if e.rcvd else None
    return session


def speak(url: str, cfg: dict, messages: list[dict], pause=None) -> Session:
    with websockets_sync.connect(url + "/v1/audio/speech/stream", open_timeout=30) as ws:
        ws.send(json.dumps(cfg))
        for m in messages:
            try:
                ws.send(json.dumps(m))
            except ConnectionClosed:  # the server refused an earlier message and closed: its events still read
                break
            if pause:
                time.sleep(pause())
        return receive(ws, Session())


@pytest.fixture(scope="module")
def ws_url(stack):  # noqa: F811
    return "ws://" + stack.http.removeprefix("http://")


# ---- with the services ------------------------------------------------------------------------

def test_events_arrive_in_order_and_each_sentence_continues_the_last(stack, ws_url):  # noqa: F811
    s = speak(ws_url, config(voice="alloy"), [{"type": "text", "text": "Hello there. How are you?"}, {"type": "end"}])
    assert s.kinds == ["ready", "sentence", "audio_done", "sentence", "audio_done", "done"], s.events
    assert s.close_code == 1000
    ready = s.events[0]
    assert (ready["sample_rate"], ready["channels"], ready["response_format"]) == (48000, 2, "pcm")
    assert [e["text"] for e in s.of("sentence")] == ["Hello there.", "How are you?"]
    assert [len(s.audio[i]) for i in (0, 1)] == [SENTENCE_BYTES] * 2
    done = s.events[-1]
    assert done["cancelled"] is False and done["usage"]["output_tokens"] == 2 * FRAMES
    assert done["usage"]["sentences"] == 2

    # the same two requests straight to the gRPC API: the second continues the first's codes
    stub = tts_pb2_grpc.TextToSpeechStub(channel(stack.address))
    first = tts_pb2.SynthesizeRequest(text="Hello there.", min_frames=FRAMES, max_frames=FRAMES, return_codes=True)
    first.sampling.seed = 7
    out = synthesize(stub, first, timeout=120)
    codes = out.code_frames().astype("<i4")
    second = tts_pb2.SynthesizeRequest(text="How are you?", min_frames=FRAMES, max_frames=FRAMES)
    second.sampling.seed = 8
    second.continuation.transcript = "Hello there. "
    second.continuation.codes.CopyFrom(common_pb2.IntMatrix(rows=codes.shape[0], cols=codes.shape[1],
                                                             data=codes.tobytes()))
    assert bytes(s.audio[0]) == out.pcm().tobytes()
    assert bytes(s.audio[1]) == synthesize(stub, second, timeout=120).pcm().tobytes()


def test_text_in_random_pieces_gives_the_same_audio_as_whole(ws_url):
    whole = speak(ws_url, config(), [{"type": "text", "text": TEXT}, {"type": "end"}])
    rng = random.Random(3)
    words, pieces = TEXT.split(" "), []
    while words:
        n = rng.randint(1, 5)
        pieces.append(" ".join(words[:n]) + (" " if len(words) > n else ""))
        words = words[n:]
    pieces = [{"type": "text", "text": p} for p in pieces] + [{"type": "end"}]
    split = speak(ws_url, config(), pieces, pause=lambda: rng.uniform(0, 0.15))
    texts = [e["text"] for e in whole.of("sentence")]
    assert texts == ["Hello Mr. Smith.", "It costs 3.5 dollars today!", "Is that fair?", "好的。", "Fine"]
    assert [e["text"] for e in split.of("sentence")] == texts
    assert len(whole.pcm()) == len(texts) * SENTENCE_BYTES
    assert split.pcm() == whole.pcm()


def test_flush_speaks_text_without_an_end_and_wav_has_one_header(ws_url):
    with websockets_sync.connect(ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps(config(response_format="wav")))
        ws.send(json.dumps({"type": "text", "text": "no full stop here"}))
        ws.send(json.dumps({"type": "flush"}))
        s = receive(ws, Session(), until=lambda m: isinstance(m, str) and json.loads(m)["type"] == "audio_done")
        assert [e["text"] for e in s.of("sentence")] == ["no full stop here"]
        ws.send(json.dumps({"type": "text", "text": "And more"}))
        ws.send(json.dumps({"type": "end"}))
        receive(ws, s)
    assert s.kinds[-1] == "done" and [e["text"] for e in s.of("sentence")] == ["no full stop here", "And more"]
    pcm = s.pcm()
    assert pcm[:4] == b"RIFF" and len(pcm) == 44 + 2 * SENTENCE_BYTES


def test_cancel_stops_at_once_and_frees_everything(stack, ws_url):  # noqa: F811
    assert wait_until_idle(stack) == (0, 0, 0, 0)
    aborted = metric(stack, "chorus_requests_aborted_total")
    frames = metric(stack, "chorus_frames_generated_total")
    with websockets_sync.connect(ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps(config(min_frames=4000, max_frames=4000)))
        ws.send(json.dumps({"type": "text", "text": "A long one. And another."}))
        s = receive(ws, Session(), until=lambda m: isinstance(m, bytes))  # audio is flowing
        ws.send(json.dumps({"type": "cancel"}))
        receive(ws, s)
    assert s.kinds[-1] == "done" and s.events[-1]["cancelled"] is True and s.close_code == 1000
    assert "audio_done" not in s.kinds
    assert wait_until_idle(stack, timeout=30) == (0, 0, 0, 0)
    assert metric(stack, "chorus_requests_aborted_total") == aborted + 1
    assert metric(stack, "chorus_frames_generated_total") - frames < 4000


def test_a_client_that_goes_away_frees_everything(stack, ws_url):  # noqa: F811
    assert wait_until_idle(stack) == (0, 0, 0, 0)
    aborted = metric(stack, "chorus_requests_aborted_total")
    with websockets_sync.connect(ws_url + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps(config(min_frames=4000, max_frames=4000)))
        ws.send(json.dumps({"type": "text", "text": "Going away now. Yes."}))
        receive(ws, Session(), until=lambda m: isinstance(m, bytes))
    assert wait_until_idle(stack, timeout=30) == (0, 0, 0, 0)
    assert metric(stack, "chorus_requests_aborted_total") == aborted + 1


BAD = [
    (config(response_format="mp3"), [], 4400, "response_format"),
    (config(input="Hello."), [], 4400, "input"),
    (config(stream_format="sse"), [], 4400, "stream_format"),
    (config(seed=-1), [], 4400, "seed"),
    (config(colour="blue"), [], 4400, "colour"),
    (config(model="no-such-model"), [], 4404, "model"),
    (config(voice="nobody"), [{"type": "text", "text": "Hi there. "}, {"type": "end"}], 4404, "voice"),
    (config(), [{"type": "shout"}], 4400, "type"),
    (config(), [{"type": "text", "text": 5}], 4400, "text"),
    (config(), [{"type": "text", "text": "Hi.", "speed": 2}], 4400, "speed"),
]


@pytest.mark.parametrize("cfg,messages,code,param", BAD, ids=[f"{c}-{p}-{i}" for i, (_, _, c, p) in enumerate(BAD)])
def test_bad_input_is_an_error_event_naming_the_field_and_a_close_code(ws_url, cfg, messages, code, param):
    s = speak(ws_url, cfg, messages)
    assert s.kinds[-1] == "error", s.events
    err = s.events[-1]["error"]
    assert err["param"] == param and err["message"], err
    assert s.close_code == code


# ---- the sentence cutter ----------------------------------------------------------------------

CUTS = [
    ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
    ("Mr. Smith met Dr. Jones at 5 p.m. today. Then they left.",
     ["Mr. Smith met Dr. Jones at 5 p.m. today.", "Then they left."]),
    ("It costs 3.5 dollars. Pi is 3.14159!", ["It costs 3.5 dollars.", "Pi is 3.14159!"]),
    ("J. K. Rowling wrote it, e.g. this one. Yes.", ["J. K. Rowling wrote it, e.g. this one.", "Yes."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("Wait... really? ok", ["Wait... really?", "ok"]),
    ("你好。今天天气很好！你去吗？", ["你好。", "今天天气很好！", "你去吗？"]),
    ("他说：“走吧。”然后走了", ["他说：“走吧。”", "然后走了"]),
    ("价格是3.5元。好的", ["价格是3.5元。", "好的"]),
    ("English first. 然后中文。Mixed!", ["English first.", "然后中文。", "Mixed!"]),
    ("A list:\n1. one\n2. two", ["A list:", "1. one", "2. two"]),
    ("no end punctuation at all", ["no end punctuation at all"]),
    ("... !!! Hi.", ["Hi."]),
]


@pytest.mark.parametrize("text,sentences", CUTS)
def test_sentence_cuts(text, sentences):
    assert split_sentences(text) == sentences


def test_a_sentence_waits_for_what_decides_it_and_flush_cuts_now():
    c = SentenceCutter()
    assert c.feed("Hello Mr.") == [] and c.feed(" Smith. It") == ["Hello Mr. Smith."]
    assert c.feed(" costs 3.") == [] and c.feed("5 now") == []
    assert c.flush() == ["It costs 3.5 now"] and c.flush() == []
    assert c.feed("好。") == [] and c.feed("下") == ["好。"]


def test_long_text_without_an_end_is_cut_at_a_comma():
    text = "word, " * 30 + "and the end."
    out = split_sentences(text, max_chars=50)
    assert all(len(s) <= 50 for s in out) and " ".join(out) == text.strip()
    assert out[0].endswith(",")


@pytest.mark.parametrize("seed", range(20))
def test_the_cut_does_not_depend_on_how_the_text_was_split(seed):
    rng = random.Random(seed)
    text = " ".join(t for t, _ in CUTS) + " " + "很长的一句话，" * 40 + "完。"
    cutter, out, i = SentenceCutter(max_chars=60), [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        out += cutter.feed(text[i:i + n])
        if rng.random() < 0.3:
            out += cutter.feed("")
        i += n
    out += cutter.flush()
    assert out == split_sentences(text, max_chars=60)


def test_the_gateway_logged_no_failure(stack):  # noqa: F811 - last: after the sessions above
    assert not [line for line in stack.gateway.lines if "Traceback" in line or "ERROR" in line], \
        "\n".join(stack.gateway.lines[-40:])

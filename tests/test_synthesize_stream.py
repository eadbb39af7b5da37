"""SynthesizeStream (text in pieces, audio out sentence by sentence) and long-form Synthesize
against the real services (tiny model, CPU): the same audio however the text was split, flush,
cancel freeing everything, bad first messages naming the field, and a long text spoken in
pieces with no words dropped, deterministic under a seed. Then the sentence cutter's rules and
each piece's request, without services."""

from __future__ import annotations

import asyncio
import queue
import random
import subprocess
import sys

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import AsyncClient, Client, Synthesis, add_response, collect
from chorus.sentences import SentenceCutter, pieces, split_sentences
from chorus.v1 import tts_pb2
from gpu_worker.config import WorkerConfig
from vocoder_svc.config import VocoderConfig
from helpers import make_cluster, metric, wait_until_idle

FRAMES = 4
TEXT = "Hello Dr. Smith. The U.S. Army paid 3.5 dollars, e.g. for food! Is that fair? 好的。Fine"
SENTENCES = ["Hello Dr. Smith.", "The U.S. Army paid 3.5 dollars, e.g. for food!", "Is that fair?", "好的。", "Fine"]
MAX_TEXT_CHARS, MAX_LONGFORM_CHARS = 80, 600
LONG = ("The river ran past the mill at dawn. Mr. Brown opened the gate, e.g. the old one by the road. "
        "He counted 3.5 bags of flour, then two more. 我们明天见。The cart left at noon, heavy and slow, "
        "and the dust rose behind it. By evening the village was quiet again.")


@pytest.fixture(scope="module")
def stack():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192"],
                      scheduler_args=["--max-text-chars", str(MAX_TEXT_CHARS),
                                      "--max-longform-chars", str(MAX_LONGFORM_CHARS)],
                      omnivoice_worker=WorkerConfig(preset="omnivoice-tiny", dtype="float32"),
                      omnivoice_vocoder=VocoderConfig(preset="higgs-tiny")) as cluster:
        with Client(cluster.address, timeout=120) as client:
            cluster.client = client
            yield cluster


def config(**kw) -> tts_pb2.SynthesizeRequest:
    req = tts_pb2.SynthesizeRequest(**{"min_frames": FRAMES, "max_frames": FRAMES, **kw})
    req.sampling.seed = 11
    return req


def word_pieces(text: str, rng: random.Random) -> list[str]:
    words, out = text.split(" "), []
    while words:
        n = rng.randint(1, 5)
        out.append(" ".join(words[:n]) + (" " if len(words) > n else ""))
        words = words[n:]
    return out


def test_text_in_random_pieces_gives_the_same_audio_as_whole(stack):
    whole = collect(stack.client.synthesize_stream(config(), [TEXT]))
    assert [s.text for s in whole.sentences] == SENTENCES
    assert [s.index for s in whole.sentences] == list(range(len(SENTENCES)))
    samples = FRAMES * whole.header.samples_per_frame
    assert [s.first_sample for s in whole.sentences] == [i * samples for i in range(len(SENTENCES))]
    assert [c.first_sample for c in whole.chunks] == list(np.cumsum([0] + [c.num_samples for c in whole.chunks])[:-1])
    assert whole.pcm().shape[0] == len(SENTENCES) * samples
    split = asyncio.run(_async_stream(stack.address, word_pieces(TEXT, random.Random(1))))
    assert [s.text for s in split.sentences] == SENTENCES
    assert split.audio_bytes == whole.audio_bytes


async def _async_stream(address: str, texts: list[str]) -> Synthesis:
    """The pieces through AsyncClient, as an async generator with an LLM's pauses between them."""
    rng = random.Random(5)

    async def llm():
        for text in texts:
            await asyncio.sleep(rng.uniform(0, 0.05))
            yield text

    out = Synthesis()
    async with AsyncClient(address, timeout=120) as client:
        async for resp in client.synthesize_stream(config(), llm()):
            add_response(out, resp, 0.0)
    return out


def test_omnivoice_speaks_each_sentence_as_a_plain_request(stack):
    cfg = tts_pb2.SynthesizeRequest(model="omnivoice")
    cfg.sampling.seed = 3
    cfg.omnivoice.num_step = 2
    texts = ["One two. ", "Three four five! ", "Six"]
    whole = collect(stack.client.synthesize_stream(cfg, ["".join(texts)]))
    assert whole.header.model.startswith("omnivoice") and (whole.header.sample_rate, whole.header.channels) == (24000, 1)
    assert [s.text for s in whole.sentences] == ["One two.", "Three four five!", "Six"]
    assert whole.pcm().shape[0] > 0
    assert collect(stack.client.synthesize_stream(cfg, texts)).audio_bytes == whole.audio_bytes


def test_flush_speaks_what_is_buffered_and_wav_has_one_header(stack):
    pieces_in: queue.Queue = queue.Queue()
    responses = stack.client.synthesize_stream(config(format=tts_pb2.WAV), iter(pieces_in.get, None))
    pieces_in.put("no full stop here")
    pieces_in.put(tts_pb2.FLUSH)
    got = []
    for resp in responses:
        got.append(resp)
        if resp.WhichOneof("kind") == "summary":
            break
    pieces_in.put("And more")
    pieces_in.put(None)  # the SDK sends END after the last piece
    out = collect(got + list(responses))
    assert out.header.format == tts_pb2.WAV
    assert [s.text for s in out.sentences] == ["no full stop here", "And more"]
    data = out.audio_bytes
    assert data[:4] == b"RIFF" and data.count(b"RIFF") == 1
    assert len(data) == 44 + 2 * FRAMES * out.header.samples_per_frame * out.header.channels * 2


def test_cancel_stops_at_once_and_frees_everything(stack):
    assert wait_until_idle(stack) == (0, 0, 0, 0)
    aborted = metric(stack, "chorus_requests_aborted_total")
    frames = metric(stack, "chorus_frames_generated_total")
    pieces_in: queue.Queue = queue.Queue()
    kinds = []
    responses = stack.client.synthesize_stream(config(min_frames=4000, max_frames=4000),
                                               iter(pieces_in.get, None))
    pieces_in.put("A long one. And another.")
    for resp in responses:
        kinds.append(resp.WhichOneof("kind"))
        if kinds[-1] == "audio":
            pieces_in.put(tts_pb2.CANCEL)
            break
    kinds += [r.WhichOneof("kind") for r in responses]  # ends OK, at once
    assert kinds[:2] == ["header", "sentence"] and "summary" not in kinds
    assert wait_until_idle(stack, timeout=30) == (0, 0, 0, 0)
    assert metric(stack, "chorus_requests_aborted_total") == aborted + 1
    assert metric(stack, "chorus_frames_generated_total") - frames < 4000


def _bad(**kw) -> tts_pb2.SynthesizeRequest:
    req = config()
    for k, v in kw.items():
        setattr(req, k, v)
    return req


def _voice(voice_id: str) -> tts_pb2.SynthesizeRequest:
    req = config()
    req.references.add(voice_id=voice_id)
    return req


Msg = tts_pb2.SynthesizeStreamRequest
BAD = [
    ([Msg(text="Hello.")], grpc.StatusCode.INVALID_ARGUMENT, "config: the first message must be the config"),
    ([Msg()], grpc.StatusCode.INVALID_ARGUMENT, "config: the first message"),
    ([], grpc.StatusCode.INVALID_ARGUMENT, "config: the stream ended before"),
    ([Msg(config=_bad(text="Hi."))], grpc.StatusCode.INVALID_ARGUMENT, "config.text must be empty"),
    ([Msg(config=_bad(max_frames=10 ** 6))], grpc.StatusCode.INVALID_ARGUMENT, "config.max_frames must be"),
    ([Msg(config=_bad(model="nobody"))], grpc.StatusCode.INVALID_ARGUMENT, "model"),
    ([Msg(config=_voice("nobody"))], grpc.StatusCode.NOT_FOUND, "config.references[0].voice_id"),
    ([Msg(config=config()), Msg(config=config())], grpc.StatusCode.INVALID_ARGUMENT, "config: only the first"),
    ([Msg(config=config()), Msg(signal=tts_pb2.STREAM_SIGNAL_UNSPECIFIED)], grpc.StatusCode.INVALID_ARGUMENT,
     "signal 0 is no signal"),
]


@pytest.mark.parametrize("messages,code,needle", BAD, ids=[n[:24] for _, _, n in BAD])
def test_a_bad_first_message_or_config_names_the_field(stack, messages, code, needle):
    stub = stack.client._stub()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.SynthesizeStream(iter(messages), timeout=60))
    assert e.value.code() == code and needle in e.value.details(), e.value.details()


def test_long_text_is_spoken_in_pieces_in_order_deterministically(stack):
    req = config(text=LONG)
    req.min_frames = req.max_frames = 4
    expected = pieces(LONG, MAX_TEXT_CHARS)
    assert len(LONG) > MAX_TEXT_CHARS and len(expected) >= 3
    first = stack.client.synthesize(req)
    assert first.summary.frames == 4 * len(expected) and not first.sentences
    assert first.pcm().shape[0] == 4 * len(expected) * first.header.samples_per_frame
    assert [c.first_sample for c in first.chunks] == list(np.cumsum([0] + [c.num_samples for c in first.chunks])[:-1])
    assert stack.client.synthesize(req).audio_bytes == first.audio_bytes
    with pytest.raises(grpc.RpcError) as e:
        stack.client.synthesize(config(text="word " * (MAX_LONGFORM_CHARS // 5 + 1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_longform_chars" in e.value.details()


def test_chorus_say_speaks_text_or_stdin_as_it_arrives(stack, tmp_path):
    from chorus.cli import main

    flags = ["--server", stack.address, "--seed", "11", "--min-frames", str(FRAMES), "--max-frames", str(FRAMES)]
    main(["say", "Hello there.", *flags, "-o", str(tmp_path / "a.wav")])
    audio, rate = sf.read(tmp_path / "a.wav", dtype="int16")
    assert rate == 48000 and audio.shape == (FRAMES * 3840, 2)
    proc = subprocess.run([sys.executable, "-m", "chorus.cli", "say", "-", *flags, "-o", str(tmp_path / "b.wav")],
                          input="Hello there. And more", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "2 sentences" in proc.stdout, proc.stderr[-2000:]
    streamed, _ = sf.read(tmp_path / "b.wav", dtype="int16")
    assert np.array_equal(streamed[:audio.shape[0]], audio)  # sentence 0 has the seed a whole request has


# ---- without services -------------------------------------------------------------------------

def _letters(text: str) -> str:
    return "".join(ch for ch in text if ch.isalnum())


@pytest.mark.parametrize("max_chars", [20, 80, 300])
def test_long_form_pieces_keep_every_word_in_order(max_chars):
    text = (LONG + " ") * 6 + "一句没有结尾的很长的中文" * 5
    out = pieces(text, max_chars)
    assert all(len(p) <= max_chars for p in out)
    assert _letters("".join(out)) == _letters(text)
    assert " ".join(" ".join(out).split()).replace(" ", "") == "".join(text.split())


CUTS = [
    ("He joined the U.S. Army in 1990. Then he left.", ["He joined the U.S. Army in 1990.", "Then he left."]),
    ("I live in the U.S. It is big.", ["I live in the U.S.", "It is big."]),
    ("Ask Dr. Smith. He knows.", ["Ask Dr. Smith.", "He knows."]),
    ("Fruit, e.g. Apples, is good. I.e. sweet.", ["Fruit, e.g. Apples, is good.", "I.e. sweet."]),
    ("It is 3.5 m long. Version 2.0.1 is out.", ["It is 3.5 m long.", "Version 2.0.1 is out."]),
    ("See p. 5 and No. 7 of Jan. 3. Done.", ["See p. 5 and No. 7 of Jan. 3.", "Done."]),
    ("It was 5 p.m. Then I left.", ["It was 5 p.m.", "Then I left."]),
    ("Back in the U.S. 他来了。", ["Back in the U.S.", "他来了。"]),
    ("价格是3.5元！你好吗？好", ["价格是3.5元！", "你好吗？", "好"]),
]


@pytest.mark.parametrize("text,sentences", CUTS)
def test_abbreviations_decimals_and_acronyms(text, sentences):
    assert split_sentences(text) == sentences


@pytest.mark.parametrize("seed", range(6))
def test_acronym_cuts_do_not_depend_on_the_pieces(seed):
    rng = random.Random(seed)
    text = " ".join(t for t, _ in CUTS)
    cutter, out, i = SentenceCutter(), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out += cutter.feed(text[i:i + n])
        i += n
    assert out + cutter.flush() == split_sentences(text)


def _codes(frames: int) -> np.ndarray:
    return np.arange(frames * 4, dtype=np.int32).reshape(frames, 4)


def test_each_piece_continues_the_latest_whole_pieces_within_the_budget():
    from scheduler_svc.synthesize_stream import Continuation

    template = config()
    template.references.add(voice_id="narrator")
    turns = Continuation(template, continues=True, max_frames=12, max_chars=1000)
    first = turns.request(0, "Hello there.")
    assert [r.voice_id for r in first.references] == ["narrator"] and first.return_codes
    turns.remember("Hello there.", _codes(5))
    turns.remember("你好。", _codes(6))
    second = turns.request(2, "好的")
    assert not second.references and second.sampling.seed == 13
    assert second.continuation.transcript == "Hello there.你好。"  # no space next to CJK text
    assert (second.continuation.codes.rows, second.continuation.codes.cols) == (11, 4)
    turns.remember("好的", _codes(4))  # 15 frames: the oldest piece drops out
    third = turns.request(3, "Next.")
    assert third.continuation.transcript == "你好。好的" and third.continuation.codes.rows == 10
    turns.remember("Next.", _codes(20))  # longer than the budget alone: back to the voice
    fourth = turns.request(4, "Last.")
    assert [r.voice_id for r in fourth.references] == ["narrator"] and not fourth.HasField("continuation")


def test_omnivoice_pieces_are_plain_requests_with_the_same_voice():
    from scheduler_svc.synthesize_stream import Continuation

    template = config(format=tts_pb2.WAV)
    template.references.add(voice_id="narrator")
    turns = Continuation(template, continues=False, max_frames=120, max_chars=1000)
    for i, text in enumerate(["One.", "Two."]):
        req = turns.request(i, text)
        assert [r.voice_id for r in req.references] == ["narrator"] and not req.HasField("continuation")
        assert (req.text, req.sampling.seed, req.return_codes, req.format) == (text, 11 + i, False, tts_pb2.PCM16)
        turns.remember(text, _codes(8))

"""A vocoder replica serving OmniVoice's codec (--preset higgs-tiny), run as a real subprocess:
DecodeClip, Encode, Info, and the errors and refusals it answers."""

from __future__ import annotations

import io
import urllib.request

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch

from chorus.audio import encode_pcm16
from chorus.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc
from helpers import free_port
from test_vocoder_service import start_vocoder
from vocoder_svc import omnivoice_audio
from vocoder_svc.higgs_codec import HiggsCodec

SEED = 7


@pytest.fixture(scope="module")
def replica():
    metrics_port = free_port()
    proc, address, seen, _ = start_vocoder("--preset", "higgs-tiny", "--seed", str(SEED), "--metrics-port",
                                           str(metrics_port), "--grace", "1", timeout=120)
    channel = grpc.insecure_channel(address)
    yield {"stub": vocoder_pb2_grpc.VocoderStub(channel), "metrics_port": metrics_port, "log": "".join(seen)}
    channel.close()
    proc.terminate()
    try:
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def codec():
    torch.set_num_threads(1)  # as the replica runs (--torch-threads 1)
    return HiggsCodec.from_preset("higgs-tiny", seed=SEED)


def matrix(codes: np.ndarray) -> common_pb2.IntMatrix:
    return common_pb2.IntMatrix(rows=codes.shape[0], cols=codes.shape[1], data=codes.astype("<i4").tobytes())


def clip_request(codes: np.ndarray, **kw) -> vocoder_pb2.DecodeClipRequest:
    fields = dict(postprocess=True, fade_seconds=0.1, pad_seconds=0.1)
    fields.update(kw)
    return vocoder_pb2.DecodeClipRequest(codes=matrix(codes), **fields)


def pcm(response: vocoder_pb2.DecodeClipResponse) -> np.ndarray:
    assert response.pcm_encoding == vocoder_pb2.PCM_FLOAT32
    out = np.frombuffer(response.pcm, "<f4")
    assert len(out) == response.num_samples
    return out


def random_codes(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(frames, 8))


def test_info_and_streaming_refused(replica):
    stub = replica["stub"]
    info = stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=10)
    assert (info.codec, info.sample_rate, info.channels, info.samples_per_frame, info.max_codebooks) == (
        "higgs_audio_v2", 24000, 1, 960, 8)
    assert "DecodeClip" in replica["log"]  # the startup line says how clips are batched
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Decode(iter([vocoder_pb2.DecodeRequest(end=True)]), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "DecodeClip" in e.value.details()


def test_decode_clip_matches_the_codec(replica, codec):
    stub = replica["stub"]
    codes = random_codes(25, 1)
    wave = codec.decode([codes])[0]
    raw = pcm(stub.DecodeClip(clip_request(codes, postprocess=False, reference_rms=0.5, fade_seconds=0,
                                           pad_seconds=0), timeout=60))
    assert len(raw) == 24000 and np.array_equal(raw, wave)
    one = stub.DecodeClip(clip_request(random_codes(1, 2), postprocess=False, fade_seconds=0, pad_seconds=0),
                          timeout=60)
    assert one.num_samples == 960
    # The reference's post-processing, per piece of a long text as asked.
    for kw in [{}, {"reference_rms": 0.03125}, {"continues": True}, {"continued": True, "reference_rms": 0.05}]:
        got = pcm(stub.DecodeClip(clip_request(codes, **kw), timeout=60))
        want = omnivoice_audio.finish_piece(
            wave, postprocess=True, reference_rms=kw.get("reference_rms") or None, fade_seconds=0.1, pad_seconds=0.1,
            continues=kw.get("continues", False), continued=kw.get("continued", False))
        assert np.array_equal(got, want), kw
    as_int16 = stub.DecodeClip(clip_request(codes, pcm_encoding=vocoder_pb2.PCM_INT16), timeout=60)
    assert as_int16.pcm_encoding == vocoder_pb2.PCM_INT16
    assert as_int16.pcm == encode_pcm16(pcm(stub.DecodeClip(clip_request(codes), timeout=60)))


def test_concurrent_clips_each_as_alone(replica):
    stub = replica["stub"]
    requests = [clip_request(random_codes(t, 10 + i), reference_rms=0.05 * (i % 2))
                for i, t in enumerate([5, 12, 5, 30, 5, 12, 1, 5])]
    alone = [stub.DecodeClip(r, timeout=60).pcm for r in requests]
    for _ in range(2):
        futures = [stub.DecodeClip.future(r, timeout=60) for r in requests]
        assert [f.result().pcm for f in futures] == alone
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{replica['metrics_port']}/metrics", timeout=10).read().decode()
    assert "chorus_vocoder_clips_total" in metrics and "chorus_vocoder_clip_decode_ms_bucket" in metrics
    assert "chorus_vocoder_clip_finish_ms_bucket" in metrics and "chorus_vocoder_clip_forwards_total" in metrics


def test_decode_clip_bad_input_names_the_field(replica):
    stub = replica["stub"]
    good = random_codes(3, 3)
    bad_code = good.copy()
    bad_code[1, 4] = 1024
    cases = [
        (clip_request(good[:, :6]), "codes: 6 columns"),
        (clip_request(bad_code), "codes: code 1024 at frame 1, codebook 4"),
        (clip_request(np.zeros((0, 8), np.int64)), "codes: 0 frames"),
        (vocoder_pb2.DecodeClipRequest(codes=common_pb2.IntMatrix(rows=2, cols=8, data=b"\0" * 12)), "codes: data"),
        (clip_request(good, pcm_encoding=7), "pcm_encoding: 7"),
        (clip_request(good, reference_rms=-1), "reference_rms: -1"),
        (clip_request(good, fade_seconds=float("nan")), "fade_seconds: nan"),
        (clip_request(good, pad_seconds=11), "pad_seconds: 11"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.DecodeClip(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert message in e.value.details()


def wav_bytes(wave: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wave, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_encode(replica, codec):
    stub = replica["stub"]
    rate = 16000
    t = np.arange(int(1.7 * rate)) / rate
    wave = (0.02 * np.sin(2 * np.pi * 200 * t) * (t > 0.3)).astype(np.float32)  # quiet, silence first
    request = vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=wav_bytes(wave, rate)))
    first = stub.Encode(request, timeout=60)
    prepared, rms = omnivoice_audio.prepare_reference(wave[None], rate)
    want = codec.encode([prepared])[0]
    assert (first.codes.rows, first.codes.cols) == want.shape and not first.cache_hit
    assert np.array_equal(np.frombuffer(first.codes.data, "<i4").reshape(want.shape), want)
    assert first.rms == np.float32(rms) and first.rms < 0.1
    again = stub.Encode(vocoder_pb2.EncodeRequest(audio=request.audio, codebooks=8), timeout=60)
    assert again.cache_hit and again.codes == first.codes and again.rms == first.rms
    for bad, code, message in [
        (vocoder_pb2.EncodeRequest(audio=request.audio, codebooks=12), grpc.StatusCode.INVALID_ARGUMENT,
         "codebooks=12"),
        (vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=wav_bytes(np.zeros(rate, np.float32), rate))),
         grpc.StatusCode.INVALID_ARGUMENT, "reference audio: nothing is left after trimming silence"),
        (vocoder_pb2.EncodeRequest(audio=common_pb2.AudioData(data=b"garbage")), grpc.StatusCode.INVALID_ARGUMENT,
         "could not decode"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(bad, timeout=30)
        assert e.value.code() == code and message in e.value.details(), e.value.details()


def test_which_settings_serve_clips(codec, tmp_path):
    from vocoder_svc.clip_servicer import serves_clips
    from vocoder_svc.config import VocoderConfig

    codec.model.save_pretrained(tmp_path / "ckpt" / "audio_tokenizer")
    (tmp_path / "moss").mkdir()
    (tmp_path / "moss" / "config.json").write_text('{"model_type": "moss-audio-tokenizer"}')
    assert serves_clips(VocoderConfig(preset="higgs-tiny")) and serves_clips(VocoderConfig(preset="higgs-full"))
    assert serves_clips(VocoderConfig(codec=str(tmp_path / "ckpt")))
    assert serves_clips(VocoderConfig(codec=str(tmp_path / "ckpt" / "audio_tokenizer"), preset="tiny"))
    assert not serves_clips(VocoderConfig(preset="tiny"))
    assert not serves_clips(VocoderConfig(codec=str(tmp_path / "moss"), preset="higgs-tiny"))  # --codec decides

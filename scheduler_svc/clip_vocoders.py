"""The OmniVoice codec's vocoder replicas (SchedulerConfig.omnivoice_vocoder) as one pool.

OmniVoice's audio is decoded whole, one finished canvas per DecodeClip call, so a call that
breaks on one replica is simply made again on another: the same replica choice, health and
failover as VocoderPool's unary calls, none of its stream replay."""

from __future__ import annotations

import numpy as np

from chorus.omnivoice import knobs as ov
from chorus.v1 import vocoder_pb2
from scheduler_svc.vocoder_client import VocoderPool

FADE_SECONDS = 0.1  # the reference's edge fade and pad
PAD_SECONDS = 0.1


class ClipVocoders(VocoderPool):
    async def decode_clip(self, request: vocoder_pb2.DecodeClipRequest,
                          timeout: float = 120.0) -> vocoder_pb2.DecodeClipResponse:
        return await self._unary("DecodeClip", lambda r: r.stub.DecodeClip(request, timeout=timeout))

    async def encode_reference(self, audio, timeout: float = 120.0) -> vocoder_pb2.EncodeResponse:
        """Reference audio -> its codes [F, 8] and its RMS before the codec's levelling."""
        return await self.encode(vocoder_pb2.EncodeRequest(audio=audio, codebooks=ov.NUM_CODEBOOKS), timeout)


def pcm_samples(resp: vocoder_pb2.DecodeClipResponse) -> np.ndarray:
    """A DecodeClip answer's mono PCM as float32 [n, 1]."""
    if resp.pcm_encoding == vocoder_pb2.PCM_INT16:
        pcm = np.frombuffer(resp.pcm, dtype="<i2").astype(np.float32) / 32767.0
    else:
        pcm = np.frombuffer(resp.pcm, dtype="<f4")
    return pcm.reshape(-1, 1)

"""One request's audio path: generated rows → a vocoder Decode stream → PCM
→ the client's format. Yields SynthesizeResponse audio (and codes) chunks
in order; raises SynthesisFailed when the request cannot be completed."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import numpy as np

from chorus.v1 import tts_pb2, vocoder_pb2
from scheduler_svc.output import AudioOutput
from scheduler_svc.scheduler import ErrorEvent, FinishEvent, FrameEvent, Request, rows_matrix
from scheduler_svc.vocoder_client import VocoderPool


class SynthesisFailed(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class AudioRelay:
    def __init__(self, vocoders: VocoderPool, codec: vocoder_pb2.VocoderInfo, n_vq: int):
        self.vocoders = vocoders
        self.codec = codec
        self.n_vq = n_vq

    async def stream(self, req: Request, output: AudioOutput, first_chunk_frames: int, chunk_frames: int,
                     return_codes: bool) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        replica = self.vocoders.pick()
        replica.open_streams += 1
        call = replica.stub.Decode()
        out_q: asyncio.Queue = asyncio.Queue()
        start = vocoder_pb2.DecodeStart(stream_id=str(req.id), first_chunk_frames=first_chunk_frames,
                                        chunk_frames=chunk_frames, codebooks=self.n_vq)
        feeder = asyncio.create_task(self._feed(req, call, start, out_q, return_codes))
        reader = asyncio.create_task(self._read(call, output, out_q))
        try:
            while True:
                item = await out_q.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                yield item
            await feeder  # surfaces a failure the reader could not see
        finally:
            for t in (feeder, reader):
                t.cancel()
            call.cancel()
            replica.open_streams -= 1

    async def _feed(self, req: Request, call, start: vocoder_pb2.DecodeStart, out_q: asyncio.Queue,
                    return_codes: bool) -> None:
        """Scheduler events → vocoder stream (and code chunks to the client)."""
        try:
            await call.write(vocoder_pb2.DecodeRequest(start=start))
            while True:
                event = await req.events.get()
                if isinstance(event, FrameEvent):
                    codes = event.row[None, 1:]
                    await call.write(vocoder_pb2.DecodeRequest(frames=rows_matrix(codes)))
                    if return_codes:
                        out_q.put_nowait(tts_pb2.SynthesizeResponse(codes=tts_pb2.CodesChunk(
                            first_frame=event.index, codes=rows_matrix(codes))))
                elif isinstance(event, FinishEvent):
                    await call.write(vocoder_pb2.DecodeRequest(end=True))
                    await call.done_writing()
                    return
                elif isinstance(event, ErrorEvent):
                    raise SynthesisFailed(grpc.StatusCode.INTERNAL, event.message)
        except grpc.aio.AioRpcError as e:
            out_q.put_nowait(SynthesisFailed(grpc.StatusCode.UNAVAILABLE, f"vocoder stream failed: {e.details()}"))
        except SynthesisFailed as e:
            out_q.put_nowait(e)

    async def _read(self, call, output: AudioOutput, out_q: asyncio.Queue) -> None:
        """Vocoder PCM → client chunks, in order; None marks the end."""
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                pcm = np.frombuffer(resp.pcm, dtype="<f4").reshape(-1, self.codec.channels)
                chunk = output.convert(pcm)
                if chunk is not None:
                    out_q.put_nowait(tts_pb2.SynthesizeResponse(audio=chunk))
            tail = output.flush()
            if tail is not None:
                out_q.put_nowait(tts_pb2.SynthesizeResponse(audio=tail))
            out_q.put_nowait(None)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                out_q.put_nowait(SynthesisFailed(grpc.StatusCode.UNAVAILABLE,
                                                 f"vocoder stream failed: {e.details()}"))

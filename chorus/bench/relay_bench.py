"""The scheduler's audio relay on its own: how many seconds of audio per second one scheduler
process can move from vocoders to clients, and what it costs in CPU.

It runs the real relay (scheduler_svc.audio_relay.AudioRelay: Decode streams over gRPC, failover
bookkeeping, format conversion) for N concurrent requests whose frames are all generated already,
and serialises every SynthesizeResponse as the public gRPC server would. By default the vocoder
sends int16 PCM, as the real one does for PCM16 clients at the native rate; --float-pcm measures
the float32 path (other formats and rates). The vocoder is a separate process that answers Decode
instantly with a fixed PCM buffer chunked like the real service (first chunk, then steady chunks,
then the tail): a real codec would hide the relay's own cost, which is what is measured here. It
is a benchmark fixture, not a stand-in for the service in tests.

    python -m chorus.bench.relay_bench --streams 16,64,256 --frames 75 --out relay_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import grpc
import numpy as np

from chorus.bench import cpu_fixture
from chorus.v1 import tts_pb2, vocoder_pb2, vocoder_pb2_grpc, worker_pb2
from scheduler_svc.audio_relay import AudioRelay
from scheduler_svc.output import AudioOutput
from scheduler_svc.request import FinishEvent, FrameEvent, Request
from scheduler_svc.vocoder_client import VocoderPool

RATE, CHANNELS, HOP, N_VQ = 48000, 2, 3840, 12


class InstantVocoder(vocoder_pb2_grpc.VocoderServicer):
    """Decode answers each chunk at once with zeros of the right size (chunking as the real service)."""

    def __init__(self, first: int, chunk: int, float_only: bool):
        self.first, self.chunk, self.float_only = first, chunk, float_only
        self.pcm = bytes(HOP * CHANNELS * 4 * max(first, chunk))

    async def Info(self, request, context):
        return vocoder_pb2.VocoderInfo(codec="instant", sample_rate=RATE, channels=CHANNELS,
                                       samples_per_frame=HOP, max_codebooks=N_VQ)

    async def Decode(self, request_iterator, context):
        first = chunk = 0
        pending = done = 0
        width, encoding = 4, vocoder_pb2.PCM_FLOAT32

        def emit(n: int) -> vocoder_pb2.DecodeResponse:
            return vocoder_pb2.DecodeResponse(first_sample=done * HOP, num_samples=n * HOP,
                                              pcm=self.pcm[:n * HOP * CHANNELS * width], first_frame=done,
                                              frames=n, pcm_encoding=encoding)

        async for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "start":
                first = req.start.first_chunk_frames or self.first
                chunk = req.start.chunk_frames or self.chunk
                if not self.float_only and req.start.pcm_encoding == vocoder_pb2.PCM_INT16:
                    width, encoding = 2, vocoder_pb2.PCM_INT16
            elif kind == "frames":
                pending += req.frames.rows
                while pending >= (first if done == 0 else chunk):
                    n = first if done == 0 else chunk
                    yield emit(n)
                    done += n
                    pending -= n
            elif kind == "end":
                if pending:
                    yield emit(pending)
                return


def _serve(port_q: mp.Queue, first: int, chunk: int, float_only: bool) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        vocoder_pb2_grpc.add_VocoderServicer_to_server(InstantVocoder(first, chunk, float_only), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def _one(relay: AudioRelay, frames: int, first: int, chunk: int) -> int:
    req = Request(prompt_rows=np.zeros((1, 1 + N_VQ), np.int32), sampling=worker_pb2.SamplingConfig(),
                  max_frames=frames)
    req.id = id(req)
    row = np.zeros(1 + N_VQ, np.int32)
    for i in range(frames):
        req.events.put_nowait(FrameEvent(i, row))
    req.events.put_nowait(FinishEvent("max_frames"))
    output = AudioOutput(RATE, CHANNELS, RATE, tts_pb2.PCM16)
    sent = 0
    async for item in relay.stream(req, output, first, chunk, False):
        sent += len(item.SerializeToString())  # what the public server writes to its client
    return sent


async def _level(relay: AudioRelay, streams: int, requests: int, frames: int, first: int, chunk: int,
                 float_pcm: bool) -> dict:
    queue = list(range(requests))
    out_bytes = 0

    async def client() -> None:
        nonlocal out_bytes
        while queue:
            queue.pop()
            sent = await _one(relay, frames, first, chunk)  # awaited first: `x += await` would lose updates
            out_bytes += sent

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    audio_s = requests * frames * HOP / RATE
    return {"streams": streams, "requests": requests, "frames": frames, "wall_s": wall, "cpu_s": cpu,
            "audio_s_per_s": audio_s / wall, "audio_s_per_cpu_s": audio_s / cpu,
            "in_mb_per_s": audio_s * RATE * CHANNELS * (4 if float_pcm else 2) / wall / 1e6, "out_mb_per_s": out_bytes / wall / 1e6}


async def run(args: argparse.Namespace) -> list[dict]:
    proc, port = cpu_fixture.spawn(_serve, args.first_chunk, args.chunk, args.float_pcm)
    try:
        pool = VocoderPool([f"127.0.0.1:{port}"])
        relay = AudioRelay(pool, await pool.info(timeout=30), N_VQ)
        await _level(relay, 4, 8, args.frames, args.first_chunk, args.chunk, args.float_pcm)  # warm-up
        levels = []
        print(f"{'streams':>8} {'requests':>9} {'audio s/s':>10} {'per CPU s':>10} {'in MB/s':>8} {'out MB/s':>9} "
              f"{'CPU %':>6}", flush=True)
        for n in args.streams:
            lv = await _level(relay, n, max(n, args.requests), args.frames, args.first_chunk, args.chunk,
                              args.float_pcm)
            levels.append(lv)
            print(f"{n:>8} {lv['requests']:>9} {lv['audio_s_per_s']:>10,.0f} {lv['audio_s_per_cpu_s']:>10,.0f} "
                  f"{lv['in_mb_per_s']:>8,.0f} {lv['out_mb_per_s']:>9,.0f} {100 * lv['cpu_s'] / lv['wall_s']:>6.0f}",
                  flush=True)
        await pool.close()
        return levels
    finally:
        proc.kill()


def main() -> None:
    ap = cpu_fixture.parser(__doc__, "--streams")
    ap.add_argument("--first-chunk", type=int, default=5, help="frames in the first audio chunk")
    ap.add_argument("--chunk", type=int, default=25, help="frames in each later audio chunk")
    ap.add_argument("--float-pcm", action="store_true",
                    help="the vocoder sends float32 PCM and the relay converts it to PCM16")
    args = cpu_fixture.parse(ap)
    cpu_fixture.save("relay", args, asyncio.run(run(args)))


if __name__ == "__main__":
    main()

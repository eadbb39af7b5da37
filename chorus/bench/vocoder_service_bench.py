"""The vocoder service on its own, through gRPC: N concurrent Decode streams, each sending its
codes in steady chunks as fast as the service answers, PCM16 back. Reports seconds of audio per
second delivered to the streams, the service's CPU, and per-step time from its metrics.

vocoder_bench measures the decoder alone; this adds the service around it: gRPC, the worker
thread's grouping of streams into steps, PCM16 conversion.

    python -m chorus.bench.vocoder_service_bench --device cuda --dtype bfloat16 --streams 64 \\
        --frames 250 --out vocoder_service_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import grpc
import numpy as np

from chorus.bench.common import write_json

from chorus.processes import Service, free_ports, read_metrics
from chorus.v1 import common_pb2, vocoder_pb2, vocoder_pb2_grpc


async def one_stream(stub, i: int, frames: int, chunk: int, n_q: int, codebook: int, seed: int,
                     t0: float) -> list[tuple[float, int]]:
    """One Decode call: all frames in `chunk`-frame messages, then end; returns its PCM messages as
    (seconds since t0, samples)."""
    codes = np.random.default_rng(seed + i).integers(0, codebook, size=(frames, n_q), dtype=np.int32)
    start = vocoder_pb2.DecodeStart(stream_id=f"bench-{i}", first_chunk_frames=chunk, chunk_frames=chunk,
                                    codebooks=n_q, pcm_encoding=vocoder_pb2.PCM_INT16)

    async def requests():
        yield vocoder_pb2.DecodeRequest(start=start)
        for a in range(0, frames, chunk):
            block = codes[a:a + chunk]
            yield vocoder_pb2.DecodeRequest(frames=common_pb2.IntMatrix(
                rows=block.shape[0], cols=n_q, data=block.astype("<i4").tobytes()))
        yield vocoder_pb2.DecodeRequest(end=True)

    return [(time.perf_counter() - t0, resp.num_samples) async for resp in stub.Decode(requests())]


def steady_rate(arrivals: list[list[tuple[float, int]]], sample_rate: int) -> float | None:
    """Audio s per s while every stream runs: from the last stream's first PCM to the first stream's
    last, the ramp up and the tail off left out (the whole-run average counts both)."""
    if not all(arrivals):
        return None
    start, end = max(a[0][0] for a in arrivals), min(a[-1][0] for a in arrivals)
    if end <= start:
        return None
    samples = sum(n for a in arrivals for t, n in a if start < t <= end)
    return samples / sample_rate / (end - start)


async def level(addresses: list[str], streams: int, frames: int, chunk: int, n_q: int, info) -> dict:
    """All streams at once, dealt round-robin over the replicas (codes drawn below 1024, the MOSS
    codec's codebook size)."""
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        stubs = [vocoder_pb2_grpc.VocoderStub(ch) for ch in channels]
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one_stream(stubs[i % len(stubs)], i, frames, chunk, n_q, 1024, 7, t0)
                                     for i in range(streams)))
        wall = time.perf_counter() - t0
    finally:
        for ch in channels:
            await ch.close()
    audio = sum(n for a in out for _, n in a) / info.sample_rate
    return {"streams": streams, "frames_per_stream": frames, "chunk": chunk, "wall_s": wall,
            "audio_s": audio, "audio_s_per_s": audio / wall,
            "steady_audio_s_per_s": steady_rate(out, info.sample_rate),
            "first_pcm_ms_p50": float(np.median([a[0][0] if a else 0.0 for a in out]) * 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="torch device of the vocoder")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--preset", default=None, help="default full on CUDA, tiny on CPU")
    ap.add_argument("--streams", default="64", help="comma-separated concurrent streams per level")
    ap.add_argument("--frames", type=int, default=250, help="frames per stream (80 ms each)")
    ap.add_argument("--chunk", type=int, default=25, help="frames per message and per decode step")
    ap.add_argument("--n-q", type=int, default=12, help="codebooks sent")
    ap.add_argument("--slots", type=int, default=64, help="each replica's --slots")
    ap.add_argument("--replicas", type=int, default=1,
                    help="vocoder processes on the device, streams dealt round-robin")
    ap.add_argument("--vocoder-arg", action="append", default=[], metavar="FLAG",
                    help="extra vocoder flag (repeatable; attach with '=', e.g. --vocoder-arg=--switch-interval-ms=5)")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    preset = args.preset or ("full" if cuda else "tiny")
    ports = free_ports(args.replicas)
    services = [Service(f"vocoder{i}" if args.replicas > 1 else "vocoder",
                        [sys.executable, "-m", "vocoder_svc.server", "--port", "0", "--metrics-port", str(port),
                         "--preset", preset, "--device", args.device, "--dtype", dtype, "--slots", str(args.slots),
                         "--graph-frames", str(args.chunk), *args.vocoder_arg])
                for i, port in enumerate(ports)]
    for svc in services:
        svc.start(echo=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    results = {"benchmark": "vocoder_service", "device": args.device, "dtype": dtype, "preset": preset,
               "config": vars(args), "levels": []}

    def totals() -> tuple[float, float, float, float]:
        """(CPU seconds, of them the gRPC processes', decode steps, decode ms) summed over the replicas
        (the rest of the CPU is the decode processes')."""
        ms = [read_metrics(p) for p in ports]
        return (sum(s.cpu_seconds() for s in services), sum(s.cpu_seconds(children=False) for s in services),
                sum(m["chorus_vocoder_decode_step_ms_count"] for m in ms),
                sum(m["chorus_vocoder_decode_step_ms_sum"] for m in ms))

    try:
        addresses = [svc.wait_ready(900) for svc in services]

        async def info():
            async with grpc.aio.insecure_channel(addresses[0]) as ch:
                return await vocoder_pb2_grpc.VocoderStub(ch).Info(vocoder_pb2.VocoderInfoRequest(), timeout=30)
        inf = asyncio.run(info())
        asyncio.run(level(addresses, 2 * len(addresses), 2 * args.chunk, args.chunk, args.n_q, inf))  # warm
        for n in [int(x) for x in args.streams.split(",")]:
            before = totals()
            r = asyncio.run(level(addresses, n, args.frames, args.chunk, args.n_q, inf))
            cpu, grpc_cpu, steps, step_ms = (a - b for a, b in zip(totals(), before))
            r["replicas"] = len(addresses)
            r["service_cpu_cores"] = cpu / r["wall_s"]
            r["grpc_process_cpu_cores"] = grpc_cpu / r["wall_s"]
            r["decode_steps"] = steps
            r["decode_step_ms_mean"] = step_ms / steps
            results["levels"].append(r)
            print(f"{n:4d} streams x {args.frames} frames on {len(addresses)} replica(s): "
                  f"{r['audio_s_per_s']:8.1f} s of audio per s (while all streams run: "
                  f"{r['steady_audio_s_per_s'] or float('nan'):.1f}), {steps:.0f} steps of "
                  f"{r['decode_step_ms_mean']:.1f} ms mean, service CPU {r['service_cpu_cores']:.2f} cores "
                  f"({r['grpc_process_cpu_cores']:.2f} in the gRPC process), "
                  f"first PCM p50 {r['first_pcm_ms_p50']:.0f} ms", flush=True)
    finally:
        for svc in services:
            svc.stop()
    write_json(args.out, results)


if __name__ == "__main__":
    main()

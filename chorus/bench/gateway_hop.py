"""What the HTTP gateway's extra hop costs: time to first audio through the gateway against the
same request straight to the gRPC API, on the CPU tiny model.

    python -m chorus.bench.gateway_hop --requests 30 --out benchmarks/results/gateway_hop_cpu.json

One request at a time, the two paths alternating (so that load from elsewhere hits both alike).
TTFA is measured at the client: request sent to the first audio byte (gRPC: the first audio
chunk; HTTP: the first body byte of `pcm`, which the gateway passes through, of `mp3`, which it
encodes, and of `pcm` with voice "alloy", which costs a failed voice lookup first). The server's own first_audio_ms is the same for both paths, so the difference of the
client-side figures is the hop.

Then the gateway's own CPU per second of audio it relays, by format (`--cost-streams` requests of
`--cost-frames` frames at once): what sizes a fleet of gateways.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from chorus.bench.common import write_json
from chorus.client import channel
from chorus.launcher import Cluster
from chorus.processes import Service
from chorus.v1 import tts_pb2, tts_pb2_grpc

TEXT = "Hello, this is a short sentence for the benchmark."


def grpc_ttfa(stub, frames: int, seed: int) -> float:
    req = tts_pb2.SynthesizeRequest(text=TEXT, min_frames=frames, max_frames=frames)
    req.sampling.seed = seed
    t0 = time.perf_counter()
    first = None
    for resp in stub.Synthesize(req, timeout=120):
        if first is None and resp.WhichOneof("kind") == "audio":
            first = time.perf_counter() - t0
    return first * 1000


def http_ttfa(client: httpx.Client, fmt: str, frames: int, seed: int, **extra) -> float:
    body = {"input": TEXT, "response_format": fmt, "seed": seed, "min_frames": frames, "max_frames": frames, **extra}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for _ in r.iter_raw():
            if first is None:
                first = time.perf_counter() - t0
    return first * 1000


def relay_cost(client: httpx.Client, gateway: Service, fmt: str, streams: int, frames: int) -> dict:
    """Gateway CPU ms per second of audio while `streams` requests of `frames` frames run at once."""
    body = {"input": TEXT, "response_format": fmt, "min_frames": frames, "max_frames": frames}

    def one(seed: int) -> int:
        with client.stream("POST", "/v1/audio/speech", json={**body, "seed": seed}) as r:
            r.raise_for_status()
            return sum(len(b) for b in r.iter_raw())

    cpu0, t0 = gateway.cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        sizes = list(pool.map(one, range(streams)))
    cpu, wall = gateway.cpu_seconds() - cpu0, time.perf_counter() - t0
    audio_s = streams * frames * 0.08
    return {"cpu_ms_per_audio_s": round(cpu * 1000 / audio_s, 2), "gateway_cpu_s": round(cpu, 3),
            "audio_s": audio_s, "wall_s": round(wall, 2), "bytes_per_stream": sizes[0]}


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)  # q[-1]: the 90th percentile
    return {"p50_ms": round(statistics.median(ms), 2), "p90_ms": round(q[-1], 2), "mean_ms": round(statistics.fmean(ms), 2),
            "min_ms": round(min(ms), 2), "n": len(ms)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30, help="requests per path")
    ap.add_argument("--frames", type=int, default=6, help="frames per request (the first chunk is 5)")
    ap.add_argument("--cost-streams", type=int, default=4, help="concurrent requests of the CPU-cost runs")
    ap.add_argument("--cost-frames", type=int, default=100, help="frames per request of the CPU-cost runs")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args(argv)
    with Cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192"]) as cluster:
        gateway = Service("gateway", [sys.executable, "-m", "gateway_svc.server", "--port", "0",
                                      "--scheduler", cluster.address])
        gateway.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            gateway.wait_ready(120)
            stub = tts_pb2_grpc.TextToSpeechStub(channel(cluster.address))
            paths = {"grpc": lambda s: grpc_ttfa(stub, args.frames, s)}
            with httpx.Client(base_url=f"http://{gateway.address}", timeout=120) as client:
                paths["http_pcm"] = lambda s: http_ttfa(client, "pcm", args.frames, s)
                paths["http_mp3"] = lambda s: http_ttfa(client, "mp3", args.frames, s)
                # an OpenAI voice name no stored voice has: one more call to learn that (NOT_FOUND)
                paths["http_pcm_alloy"] = lambda s: http_ttfa(client, "pcm", args.frames, s, voice="alloy")
                for f in paths.values():  # warm every path once
                    f(0)
                ms: dict[str, list[float]] = {k: [] for k in paths}
                for i in range(args.requests):
                    order = list(paths) if i % 2 == 0 else list(reversed(paths))
                    for k in order:
                        ms[k].append(paths[k](i + 1))
                cost = {fmt: relay_cost(client, gateway, fmt, args.cost_streams, args.cost_frames)
                        for fmt in ("pcm", "flac", "opus", "mp3")}
        finally:
            gateway.stop()
    result = {"benchmark": "gateway_hop", "host": platform.node(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "config": vars(args),
              "ttfa": {k: summary(v) for k, v in ms.items()}, "relay_cost": cost}
    # paired: each HTTP request against the gRPC request next to it, so shared load cancels out
    result["hop_ms"] = {k: summary([h - g for h, g in zip(ms[k], ms["grpc"])]) for k in ms if k != "grpc"}
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("ttfa", "hop_ms", "relay_cost")}, indent=1))
    return result


if __name__ == "__main__":
    main()

"""First-audio latency of streamed text in, over the WebSocket speech stream and over gRPC
SynthesizeStream (which the WebSocket is a client of), on the CPU tiny model.

    python -m chorus.bench.speech_stream --sessions=20 --out benchmarks/results/speech_stream_cpu.json

Each session sends a three-sentence text a word at a time, `--word-ms` apart (an LLM's pace), then
`end`. The first sentence is complete when the piece that lets the cutter decide arrives (the next
word: a full stop alone could be "Mr."), so the latency is timed from sending that piece to the
first audio frame. Beside each session, the same first sentence as one POST /v1/audio/speech
(`pcm`, same seed: the same request reaches the scheduler) gives the plain TTFA it is compared with.
Then the later sentences: each continues the previous audio, so it starts only when that one is
generated; the stall figures are how long a player that starts at the first frame would wait for
audio in all (0: no gap), at the sentences' starts and within them (the chunk policy's share).
Each session is also run straight over SynthesizeStream (the SDK's Client.synthesize_stream),
timed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import httpx
from websockets.sync.client import connect

from chorus.bench.common import write_json
from chorus.client import Client
from chorus.v1 import tts_pb2
from chorus.launcher import Cluster
from chorus.processes import Service
from chorus.sentences import SentenceCutter

TEXT = ("Hello, this is the first sentence of the answer. The second one follows it closely, "
        "a little longer than the first. And a third to end.")
BYTES_PER_SECOND = 48000 * 2 * 2  # int16 stereo at the tiny model's 48 kHz


def completing_piece(pieces: list[str]) -> int:
    """Index of the piece after which the first sentence is cut."""
    cutter = SentenceCutter()
    return next(i for i, p in enumerate(pieces) if cutter.feed(p))


def session(url: str, pieces: list[str], word_s: float, frames: int, seed: int) -> dict:
    sent: list[float] = []
    arrivals: list[tuple[float, int, bool]] = []  # (time, bytes, a sentence's first?) of each audio frame
    starts: dict[int, float] = {}  # sentence index -> time its first audio arrived
    with connect(url + "/v1/audio/speech/stream", open_timeout=30) as ws:
        ws.send(json.dumps({"seed": seed, "min_frames": frames, "max_frames": frames}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"

        def write():
            for p in pieces:
                ws.send(json.dumps({"type": "text", "text": p}))
                sent.append(time.perf_counter())
                time.sleep(word_s)
            ws.send(json.dumps({"type": "end"}))

        writer = threading.Thread(target=write)
        writer.start()
        index = -1
        while True:
            msg = ws.recv(timeout=120)
            now = time.perf_counter()
            if isinstance(msg, bytes):
                arrivals.append((now, len(msg), index not in starts))
                starts.setdefault(index, now)
                continue
            event = json.loads(msg)
            if event["type"] == "sentence":
                index = event["index"]
            elif event["type"] == "done":
                break
            elif event["type"] == "error":
                raise RuntimeError(event)
        writer.join()
    first = starts[0] - sent[completing_piece(pieces)]
    # a player that starts at the first frame: how long it waits for audio in all
    play_at, stall = arrivals[0][0], {True: 0.0, False: 0.0}  # at a sentence's start, within one
    for t, n, opens in arrivals:
        if t > play_at:
            stall[opens] += t - play_at
            play_at = t
        play_at += n / BYTES_PER_SECOND
    return {"first_sentence_ms": first * 1000, "stall_between_ms": stall[True] * 1000,
            "stall_within_ms": stall[False] * 1000, "sentences": len(starts)}


def grpc_session(client: Client, pieces: list[str], word_s: float, frames: int, seed: int) -> float:
    """ms from sending the piece that completes the first sentence to its first audio, over gRPC."""
    sent: list[float] = []

    def write():
        for p in pieces:
            sent.append(time.perf_counter())
            yield p
            time.sleep(word_s)

    config = tts_pb2.SynthesizeRequest(min_frames=frames, max_frames=frames)
    config.sampling.seed = seed
    first = None
    for resp in client.synthesize_stream(config, write()):
        if first is None and resp.HasField("audio"):
            first = time.perf_counter()
    return (first - sent[completing_piece(pieces)]) * 1000


def post_ttfa(client: httpx.Client, text: str, frames: int, seed: int) -> float:
    body = {"input": text, "response_format": "pcm", "seed": seed, "min_frames": frames, "max_frames": frames}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        body_bytes = r.iter_raw()
        next(body_bytes)
        first = time.perf_counter() - t0
        for _ in body_bytes:
            pass
    return first * 1000


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"p50_ms": round(statistics.median(ms), 2), "p90_ms": round(q[-1], 2),
            "mean_ms": round(statistics.fmean(ms), 2), "max_ms": round(max(ms), 2), "n": len(ms)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=20, help="WebSocket sessions (each beside one POST)")
    ap.add_argument("--frames", type=int, default=25, help="frames per sentence (80 ms each)")
    ap.add_argument("--word-ms", type=float, default=40.0, help="ms between the words sent")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args(argv)
    words = TEXT.split(" ")
    pieces = [w + " " for w in words[:-1]] + [words[-1]]
    first_sentence = SentenceCutter().feed(TEXT + " ")[0]
    with Cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192"]) as cluster:
        gateway = Service("gateway", [sys.executable, "-m", "gateway_svc.server", "--port", "0",
                                      "--scheduler", cluster.address])
        gateway.start(False, dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            gateway.wait_ready(120)
            url = f"ws://{gateway.address}"
            with httpx.Client(base_url=f"http://{gateway.address}", timeout=120) as client, \
                    Client(cluster.address, timeout=120) as grpc_client:
                post_ttfa(client, first_sentence, args.frames, 0)  # warm both paths
                session(url, pieces, args.word_ms / 1000, args.frames, 0)
                runs, posts, grpcs = [], [], []
                for i in range(args.sessions):
                    runs.append(session(url, pieces, args.word_ms / 1000, args.frames, i + 1))
                    posts.append(post_ttfa(client, first_sentence, args.frames, i + 1))
                    grpcs.append(grpc_session(grpc_client, pieces, args.word_ms / 1000, args.frames, i + 1))
        finally:
            gateway.stop()
    ws_first = [r["first_sentence_ms"] for r in runs]
    result = {"benchmark": "speech_stream", "host": platform.node(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "config": vars(args), "text": TEXT,
              "first_audio_from_first_sentence": summary(ws_first),
              "post_ttfa_same_sentence": summary(posts),
              "grpc_first_audio_from_first_sentence": summary(grpcs),
              "paired_extra": summary([w - p for w, p in zip(ws_first, posts)]),
              "stall_between_sentences": summary([r["stall_between_ms"] for r in runs]),
              "stall_within_sentences": summary([r["stall_within_ms"] for r in runs]),
              "sentences": runs[0]["sentences"]}
    write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("config", "text")}, indent=1))
    return result


if __name__ == "__main__":
    main()

"""chorus bench: a load generator that drives the public gRPC API
(chorus.v1.TextToSpeech/Synthesize).

It runs one asyncio (grpc.aio) client in one process, so hundreds of
concurrent streams cost little. Two modes:

  closed loop (default)  N streams, each sending its next request as soon as
                         the last one finishes, at each level of --concurrency.
  open loop (--rate)     requests arrive as a Poisson process at each rate
                         (req/s) in --rate, however many are already in flight.

Each level runs a --warmup (seconds, not measured), then measures for
--duration seconds, or until --requests requests have been sent. After that
no new request starts, and the ones in flight finish. A request is
"measured" if it was sent after the warm-up. Its latencies count even when it
finishes after the window. Throughput (req/s, audio-s/s, frames/s) counts
what arrived inside the window: [end of warm-up, end of --duration]. With
--requests, the window ends when the last measured request finishes.

Workloads (every request has its own sampling seed; min_frames = max_frames,
so random weights still produce exactly that many frames):
  W1  short: about 25 English words, 75 frames (6 s), no reference
  W2  clone: as W1, plus one of --voices voice references (5 s = 63 frames of
      codec codes each, made from --seed) picked at random per request, so
      radix reuse of the reference prefix shows up
  W3  long:  about 75 English words, 375 frames (30 s), no reference

Per request it measures: TTFA (send to first audio chunk), total time,
audio seconds received, RTF (total time / audio seconds), the gaps between
consecutive audio chunks, frames, and the server summary's prompt/cached rows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "chorus-bench/1"
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 256)
VOICE_FRAMES = 63  # 5 s at 12.5 frames/s

EXAMPLES = """\
examples:
  # CPU smoke run: launch the tiny model locally, two levels, 4 requests each
  chorus bench --launch --workload W1 --concurrency 1,2 --frames 10 --requests 4 \\
      --out /tmp/b.json --plot /tmp/b.png

  # against a running GPU scheduler: clone workload, full sweep, 60 s per level
  chorus bench --server 10.0.0.5:50051 --workload W2 --concurrency 1,4,16,64,256 \\
      --duration 60 --warmup 10 --device-note "1x H200, bf16" --out w2.json --plot w2.png

  # open loop: Poisson arrivals at 2, 5 and 10 req/s for 30 s each
  chorus bench --server 127.0.0.1:50051 --workload W1 --rate 2,5,10 --duration 30

Flags that start with '-' must be attached with '=': --worker-arg=--kv-slots=65536
"""


@dataclass(frozen=True)
class Workload:
    name: str
    frames: int
    words: int
    clone: bool
    description: str


WORKLOADS = {
    "W1": Workload("W1", 75, 25, False, "short: ~25 words, 75 frames (6 s), no reference"),
    "W2": Workload("W2", 75, 25, True, "clone: ~25 words, 75 frames, one of --voices 63-frame references"),
    "W3": Workload("W3", 375, 75, False, "long: ~75 words, 375 frames (30 s), no reference"),
}

# Clauses that are joined into texts. Each request draws its own, so prompts
# differ after the shared header and the radix cache only reuses what a real
# deployment would share (the header, and W2's voice reference).
_CLAUSES = (
    "the morning train left the station early", "a quiet wind moved across the valley",
    "she opened the letter with careful hands", "our team finished the report on time",
    "the old bridge was painted bright blue", "children laughed in the park after school",
    "he ordered coffee and a slice of cake", "the museum opens again next Tuesday",
    "rain fell softly on the tin roof", "the market was busy with summer fruit",
    "please remember to close the kitchen window", "the river rose after three days of storms",
    "a small boat drifted toward the harbor", "the library keeps its rare maps downstairs",
    "we walked home under a sky full of stars", "the new software update fixed the bug",
    "my neighbor grows tomatoes on her balcony", "the concert ended with a long standing ovation",
    "snow covered the mountain road by noon", "the bakery sells fresh bread every morning",
    "the pilot announced a short delay", "our guide told stories about the castle",
    "the cat slept in a patch of sunlight", "traffic moved slowly through the city center",
    "the students prepared for their final exams", "a bright comet appeared in the northern sky",
    "the chef tasted the soup and added salt", "the meeting has been moved to Friday afternoon",
    "old photographs filled the wooden drawer", "the garden smelled of roses and cut grass",
    "the engineers tested the engine twice", "a friendly dog followed us to the beach",
)


def make_text(rng: random.Random, words: int) -> str:
    """About `words` words of plain English: sentences of one or two clauses."""
    sentences, count = [], 0
    while count < words:
        parts = [rng.choice(_CLAUSES)]
        if words - count > 10 and rng.random() < 0.6:
            parts.append(rng.choice(("and", "while", "because", "but")) + " " + rng.choice(_CLAUSES))
        s = " ".join(parts)
        count += len(s.split())
        sentences.append(s[0].upper() + s[1:] + ".")
    return " ".join(sentences)


# ---- argument parsing ------------------------------------------------------------------

def _int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return out


def _float_list(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected rates > 0, got {s!r}")
    return out


def _workloads(s: str) -> list[str]:
    out = [w.strip().upper() for w in s.split(",") if w.strip()]
    bad = [w for w in out if w not in WORKLOADS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"workloads are {', '.join(WORKLOADS)}; got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target (one of)")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--server", metavar="HOST:PORT",
                   help="address of a running scheduler (default 127.0.0.1:50051 unless --launch)")
    g.add_argument("--launch", action="store_true",
                   help="start a local worker + vocoder + scheduler (chorus.launcher.Cluster) for the run and "
                        "stop them at the end; tiny random-weight model on the CPU unless --model/--codec/--device")

    la = p.add_argument_group("with --launch")
    la.add_argument("--model", metavar="DIR", help="MOSS-TTS Local checkpoint directory (default: tiny preset)")
    la.add_argument("--codec", metavar="DIR", help="MOSS-Audio-Tokenizer directory (default: tiny preset)")
    la.add_argument("--device", default="cpu", help="torch device of the worker and vocoder (default cpu)")
    la.add_argument("--dtype", default=None, help="compute dtype (default float32 on cpu, bfloat16 otherwise)")
    la.add_argument("--vocoders", type=int, default=1, metavar="N", help="vocoder replicas to start (default 1)")
    la.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                    help="extra gpu_worker flag, repeatable; attach with '=': --worker-arg=--kv-slots=65536")
    la.add_argument("--vocoder-arg", action="append", default=[], metavar="FLAG",
                    help="extra vocoder flag, repeatable (e.g. --vocoder-arg=--max-batch-streams=16)")
    la.add_argument("--scheduler-arg", action="append", default=[], metavar="FLAG",
                    help="extra scheduler flag, repeatable (e.g. --scheduler-arg=--max-queue=1024)")
    la.add_argument("--server-logs", action="store_true", help="relay the launched services' logs")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", type=_workloads, default=["W1"], metavar="W[,W...]",
                   help="W1 short, W2 clone, W3 long; a comma list runs each in turn (default W1)")
    w.add_argument("--frames", type=int, default=None, metavar="N",
                   help="frames per request (min = max), overriding the workload's 75/375; for quick smoke runs")
    w.add_argument("--voices", type=int, default=8, metavar="N", help="W2: distinct voice references (default 8)")
    w.add_argument("--voice-frames", type=int, default=VOICE_FRAMES, metavar="N",
                   help=f"W2: frames per reference (default {VOICE_FRAMES} = 5 s)")
    w.add_argument("--code-vocab", type=int, default=1024, metavar="N",
                   help="W2: reference codes are drawn from [0, N) (default 1024, the model's audio vocab)")
    w.add_argument("--seed", type=int, default=None,
                   help="base seed: request k uses sampling seed SEED+k, and texts and voices come from it "
                        "(default: random, recorded in the JSON)")
    w.add_argument("--language", default="English", metavar="NAME", help="language field of each request (default English)")
    w.add_argument("--sample-rate", type=int, default=0, metavar="HZ", help="output sample rate to ask for (0 = native)")
    w.add_argument("--first-chunk-frames", type=int, default=0, metavar="N", help="frames in the first audio chunk "
                                                                      "(0 = server default)")
    w.add_argument("--chunk-frames", type=int, default=0, metavar="N", help="frames per later audio chunk (0 = server default)")

    m = p.add_argument_group("load")
    mg = m.add_mutually_exclusive_group()
    mg.add_argument("--concurrency", type=_int_list, default=list(DEFAULT_CONCURRENCY), metavar="N[,N...]",
                    help="closed loop: concurrent streams per level (default 1,4,16,64,256)")
    mg.add_argument("--rate", type=_float_list, default=None, metavar="R[,R...]",
                    help="open loop instead: Poisson arrivals at R req/s per level")
    m.add_argument("--duration", type=float, default=5.0, metavar="S",
                   help="measured seconds per level, after the warm-up (default 5)")
    m.add_argument("--requests", type=int, default=None, metavar="N",
                   help="measure N requests per level instead of --duration seconds")
    m.add_argument("--warmup", type=float, default=1.0, metavar="S",
                   help="seconds of unmeasured load at the start of each level, also with --requests (default 1)")
    m.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request deadline (default 600)")
    m.add_argument("--channels", type=int, default=4, metavar="N",
                   help="gRPC channels (TCP connections) the streams are spread over (default 4)")

    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="JSON", help="write config, git revision, per-level metrics and raw records")
    o.add_argument("--plot", metavar="PNG",
                   help="plot audio-s/s and TTFA p50/p99 against concurrency (or rate); needs matplotlib "
                        "(pip install -e '.[bench]')")
    o.add_argument("--device-note", metavar="TEXT", help="free text describing the server's host/device, "
                                                          "stored in the JSON and the plot title")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load-test a scheduler over the public gRPC API (closed/open loop sweeps)",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench flags on their own (for programmatic use and tests)."""
    p = argparse.ArgumentParser(prog="chorus bench", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p.parse_args(argv)


def cmd_bench(args: argparse.Namespace) -> None:
    results = run_bench(args)
    measured = sum(lv["requests"] for lv in results["levels"])
    failed = sum(lv["errors"] for lv in results["levels"])
    if measured and failed == measured:
        sys.exit(1)


# ---- statistics ---------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(values: list[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    out = {f"p{q}": percentile(values, q) for q in qs}
    out["mean"] = sum(values) / len(values) if values else None
    out["max"] = max(values) if values else None
    return out


def level_metrics(records: list[dict], window: tuple[float, float]) -> dict[str, Any]:
    """Metrics of one level from its records (times in seconds since the run
    started; each record keeps its audio chunks as `_chunks` [(t, samples)])."""
    ws, we = window
    span = we - ws
    measured = [r for r in records if r["measured"]]
    ok = [r for r in measured if r["error"] is None]
    errs = [r for r in measured if r["error"] is not None]
    warm_errs = [r for r in records if not r["measured"] and r["error"] is not None]
    audio_s = frames = 0.0
    for r in records:
        sr, spf = r.get("sample_rate") or 0, r.get("samples_per_frame") or 0
        for t, n in r["_chunks"]:
            if ws <= t <= we:
                audio_s += n / sr if sr else 0.0
                frames += n / spf if spf else 0.0
    done = sum(1 for r in records if r["error"] is None and ws <= r["t_end_s"] <= we)
    gaps = [g for r in ok for g in r["gaps_ms"]]
    max_gaps = [r["max_gap_ms"] for r in ok if r["max_gap_ms"] is not None]
    cached = [r["cached_prompt_rows"] for r in ok]
    first_error = (errs or warm_errs or [{"error": None}])[0]["error"]
    return {
        "window_s": span,
        "requests": len(measured),
        "completed": len(ok),
        "errors": len(errs),
        "warmup_requests": len(records) - len(measured),
        "warmup_errors": len(warm_errs),
        "first_error": first_error,
        "req_per_s": done / span if span > 0 else None,
        "audio_s_per_s": audio_s / span if span > 0 else None,
        "frames_per_s": frames / span if span > 0 else None,
        "ttfa_ms": _stats([r["ttfa_ms"] for r in ok]),
        "total_ms": _stats([r["total_ms"] for r in ok]),
        "rtf": _stats([r["rtf"] for r in ok]),
        "chunk_gap_ms": _stats(gaps),
        "max_gap_ms": _stats(max_gaps),
        "server_queue_ms": _stats([r["server_queue_ms"] for r in ok]),
        "server_first_audio_ms": _stats([r["server_first_audio_ms"] for r in ok]),
        "prompt_rows_mean": sum(r["prompt_rows"] for r in ok) / len(ok) if ok else None,
        "cached_prompt_rows": {"mean": sum(cached) / len(cached) if cached else None, "total": sum(cached)},
    }


# ---- the load generator ---------------------------------------------------------------

@dataclass
class _Level:
    workload: Workload
    mode: str                 # "closed" | "open"
    value: float              # concurrency or rate
    t0: float                 # seconds since run start
    warmup: float
    duration: float
    target: int | None        # --requests
    records: list[dict] = field(default_factory=list)
    issued_measured: int = 0
    inflight: int = 0

    @property
    def t_warm(self) -> float:
        return self.t0 + self.warmup

    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "closed" else f"rate={self.value:g}"

    def may_issue(self, now: float) -> bool:
        if self.target is not None:
            return now < self.t_warm or self.issued_measured < self.target
        return now < self.t_warm + self.duration


class _Runner:
    def __init__(self, args: argparse.Namespace, address: str, seed: int):
        self.args = args
        self.address = address
        self.seed = seed
        self.counter = 0
        self.origin = time.perf_counter()
        self.voices: list = []
        self.stubs: list = []
        self.channels: list = []
        self.models: list[dict] = []

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def connect(self) -> None:
        import grpc

        from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc

        opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
        self.channels = [grpc.aio.insecure_channel(self.address, options=opts)
                         for _ in range(max(1, self.args.channels))]
        self.stubs = [tts_pb2_grpc.TextToSpeechStub(c) for c in self.channels]
        resp = await self.stubs[0].ListModels(tts_pb2.ListModelsRequest(), timeout=30, wait_for_ready=True)
        self.models = [{"name": m.name, "architecture": m.architecture, "sample_rate": m.sample_rate,
                        "channels": m.channels, "frame_rate": m.frame_rate, "codebooks": m.codebooks,
                        "max_frames": m.max_frames, "is_default": m.is_default} for m in resp.models]
        n_vq = next((m["codebooks"] for m in self.models if m["is_default"]), None) or \
            (self.models[0]["codebooks"] if self.models else 12)
        import numpy as np
        for v in range(self.args.voices):
            rng = np.random.default_rng([self.seed, 7919, v])
            codes = rng.integers(0, self.args.code_vocab, (self.args.voice_frames, n_vq)).astype("<i4")
            self.voices.append(tts_pb2.VoiceReference(codes=common_pb2.IntMatrix(
                rows=codes.shape[0], cols=codes.shape[1], data=codes.tobytes())))

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    def _request(self, wl: Workload, k: int):
        from chorus.v1 import tts_pb2

        rng = random.Random(f"{self.seed}/{k}")
        frames = self.args.frames or wl.frames
        req = tts_pb2.SynthesizeRequest(
            text=make_text(rng, wl.words), language=self.args.language, min_frames=frames, max_frames=frames,
            format=tts_pb2.PCM16, sample_rate=self.args.sample_rate, request_id=f"bench-{self.seed}-{k}",
            streaming=tts_pb2.StreamingPolicy(first_chunk_frames=self.args.first_chunk_frames,
                                              chunk_frames=self.args.chunk_frames))
        req.sampling.seed = (self.seed + k) % (1 << 64)
        voice = None
        if wl.clone and self.voices:
            voice = rng.randrange(len(self.voices))
            req.references.append(self.voices[voice])
        return req, voice

    async def one(self, level: _Level, measured: bool) -> None:
        import grpc

        k = self.counter
        self.counter += 1
        req, voice = self._request(level.workload, k)
        rec: dict[str, Any] = {
            "level": None, "workload": level.workload.name, "mode": level.mode,
            "concurrency": int(level.value) if level.mode == "closed" else None,
            "rate": level.value if level.mode == "open" else None,
            "index": k, "seed": req.sampling.seed, "voice": voice, "measured": measured,
            "frames_requested": req.max_frames, "error": None,
        }
        chunks: list[tuple[float, int]] = []
        summary = header = None
        stub = self.stubs[k % len(self.stubs)]
        level.inflight += 1
        t_send = self.now()
        try:
            async for resp in stub.Synthesize(req, timeout=self.args.timeout):
                kind = resp.WhichOneof("kind")
                if kind == "audio":
                    chunks.append((self.now(), resp.audio.num_samples))
                elif kind == "header":
                    header = resp.header
                elif kind == "summary":
                    summary = resp.summary
            if header is None or summary is None or not chunks:
                raise RuntimeError("stream ended without " + ("a header" if header is None else
                                                             "a summary" if summary is None else "audio"))
        except grpc.aio.AioRpcError as e:
            rec["error"] = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a benchmark error, recorded
            rec["error"] = f"{type(e).__name__}: {e}"
        finally:
            level.inflight -= 1
        t_end = self.now()
        sr = header.sample_rate if header else 0
        samples = sum(n for _, n in chunks)
        audio_s = samples / sr if sr else 0.0
        total_s = t_end - t_send
        gaps = [(b[0] - a[0]) * 1e3 for a, b in zip(chunks, chunks[1:])]
        rec.update({
            "t_send_s": t_send, "t_end_s": t_end,
            "ttfa_ms": (chunks[0][0] - t_send) * 1e3 if chunks else None,
            "total_ms": total_s * 1e3,
            "audio_s": audio_s,
            "rtf": total_s / audio_s if audio_s > 0 else None,
            "chunks": len(chunks),
            "gaps_ms": gaps,
            "max_gap_ms": max(gaps) if gaps else None,
            "frames": summary.frames if summary else None,
            "finish_reason": summary.finish_reason if summary else None,
            "prompt_rows": summary.prompt_rows if summary else None,
            "cached_prompt_rows": summary.cached_prompt_rows if summary else None,
            "server_queue_ms": summary.queue_ms if summary else None,
            "server_first_audio_ms": summary.first_audio_ms if summary else None,
            "server_total_ms": summary.total_ms if summary else None,
            "sample_rate": sr,
            "samples_per_frame": header.samples_per_frame if header else 0,
            "_chunks": chunks,
        })
        level.records.append(rec)

    async def closed_level(self, level: _Level) -> None:
        async def stream() -> None:
            while True:
                now = self.now()
                if not level.may_issue(now):
                    break
                measured = now >= level.t_warm
                level.issued_measured += measured
                await self.one(level, measured)

        await asyncio.gather(*(stream() for _ in range(int(level.value))))

    async def open_level(self, level: _Level) -> None:
        rng = random.Random(f"{self.seed}/arrivals/{level.value}/{level.t0}")
        tasks: set[asyncio.Task] = set()
        t = level.t0
        while True:
            t += rng.expovariate(level.value)
            if level.target is None and t >= level.t_warm + level.duration:
                break
            if level.target is not None and t >= level.t_warm and level.issued_measured >= level.target:
                break
            delay = t - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            measured = t >= level.t_warm
            level.issued_measured += measured
            task = asyncio.create_task(self.one(level, measured))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))


class _Progress:
    """A one-line text progress bar on stderr."""

    WIDTH = 28

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_plain = 0.0

    def draw(self, runner: _Runner, level: _Level, final: bool = False) -> None:
        if not self.enabled:
            return
        now = runner.now()
        measured = [r for r in level.records if r["measured"]]
        if level.target is not None:
            frac = len(measured) / level.target if now >= level.t_warm else 0.0
        else:
            frac = (now - level.t0) / max(1e-9, level.warmup + level.duration)
        frac = 1.0 if final else min(1.0, max(0.0, frac))
        fill = int(round(frac * self.WIDTH))
        phase = "warm-up" if now < level.t_warm else ("draining" if not level.may_issue(now) else "measuring")
        errs = sum(1 for r in level.records if r["error"] is not None)
        line = (f"{level.workload.name} {level.label():>10} [{'#' * fill}{'.' * (self.WIDTH - fill)}] "
                f"{frac * 100:3.0f}% {phase:9} done {len(measured):5d} in-flight {level.inflight:4d} "
                f"err {errs:3d} {now - level.t0:6.1f}s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
            sys.stderr.flush()
        elif final or now - self.last_plain >= 5.0:
            self.last_plain = now
            print(line, file=sys.stderr, flush=True)

    async def run(self, runner: _Runner, level: _Level) -> None:
        try:
            while True:
                self.draw(runner, level)
                await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            self.draw(runner, level, final=True)
            raise


_TABLE_COLS = (("workload", 8), ("level", 10), ("reqs", 5), ("err", 4), ("req/s", 7), ("audio-s/s", 9),
               ("frames/s", 9), ("TTFA p50", 9), ("p95", 8), ("p99", 8), ("RTF p50", 8), ("p99", 7),
               ("gap p99", 8), ("cached", 7))


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table_header() -> str:
    head = " ".join(name.rjust(w) for name, w in _TABLE_COLS)
    return head + "\n" + " ".join("-" * w for _, w in _TABLE_COLS) + "\n" + \
        "(latencies in ms; TTFA = send to first audio chunk; gap = between audio chunks; cached = mean " \
        "cached prompt rows)"


def table_row(lv: dict) -> str:
    label = f"c={lv['concurrency']}" if lv["mode"] == "closed" else f"rate={lv['rate']:g}"
    vals = (lv["workload"], label, str(lv["requests"]), str(lv["errors"]), _fmt(lv["req_per_s"], ".2f"),
            _fmt(lv["audio_s_per_s"], ".2f"), _fmt(lv["frames_per_s"], ".1f"), _fmt(lv["ttfa_ms"]["p50"], ".0f"),
            _fmt(lv["ttfa_ms"]["p95"], ".0f"), _fmt(lv["ttfa_ms"]["p99"], ".0f"), _fmt(lv["rtf"]["p50"], ".3f"),
            _fmt(lv["rtf"]["p99"], ".3f"), _fmt(lv["chunk_gap_ms"]["p99"], ".0f"),
            _fmt(lv["cached_prompt_rows"]["mean"], ".0f"))
    return " ".join(v.rjust(w) for v, (_, w) in zip(vals, _TABLE_COLS))


def _service_cpu(services: list) -> dict[str, float | None]:
    return {s.name: s.cpu_seconds() for s in services}


async def _run_levels(args: argparse.Namespace, address: str, seed: int, results: dict,
                      services: list | None = None) -> None:
    """services: the launched processes (chorus.launcher.Service), whose CPU use each level records."""
    services = services or []
    runner = _Runner(args, address, seed)
    progress = _Progress(not args.no_progress)
    await runner.connect()
    results["server"]["models"] = runner.models
    print(table_header(), flush=True)
    mode = "open" if args.rate else "closed"
    values = args.rate if args.rate else args.concurrency
    try:
        for wname in args.workload:
            wl = WORKLOADS[wname]
            for value in values:
                level = _Level(wl, mode, value, runner.now(), max(0.0, args.warmup), args.duration, args.requests)
                cpu0, wall0, server_cpu0 = time.process_time(), runner.now(), _service_cpu(services)
                bar = asyncio.create_task(progress.run(runner, level))
                try:
                    await (runner.closed_level(level) if mode == "closed" else runner.open_level(level))
                finally:
                    bar.cancel()
                    try:
                        await bar
                    except asyncio.CancelledError:
                        pass
                wall = runner.now() - wall0
                if args.requests is not None:
                    ends = [r["t_end_s"] for r in level.records if r["measured"]]
                    window = (level.t_warm, max(ends) if ends else level.t_warm)
                else:
                    window = (level.t_warm, level.t_warm + args.duration)
                idx = len(results["levels"])
                lv = {"workload": wl.name, "mode": mode,
                      "concurrency": int(value) if mode == "closed" else None,
                      "rate": value if mode == "open" else None,
                      "frames_per_request": args.frames or wl.frames,
                      **level_metrics(level.records, window),
                      "wall_s": wall, "client_cpu": (time.process_time() - cpu0) / wall if wall > 0 else None,
                      # cores each launched service kept busy over the level (warm-up and drain included)
                      "server_cpu": {name: (t - server_cpu0[name]) / wall if t is not None and wall > 0
                                     and server_cpu0[name] is not None else None
                                     for name, t in _service_cpu(services).items()}}
                results["levels"].append(lv)
                for r in level.records:
                    r["level"] = idx
                    del r["_chunks"]
                results["records"].extend(level.records)
                print(table_row(lv), flush=True)
                if any(v is not None for v in lv["server_cpu"].values()):
                    print("           server CPU (cores busy): " + ", ".join(
                        f"{name} {v:.2f}" for name, v in lv["server_cpu"].items() if v is not None), flush=True)
    finally:
        await runner.close()


# ---- run, JSON, plot --------------------------------------------------------------------

def git_revision() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode != 0:
            return {"revision": None, "dirty": None}
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10)
        return {"revision": rev.stdout.strip(), "dirty": bool(st.stdout.strip()) if st.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}


def _host() -> dict[str, Any]:
    import grpc
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "grpc": grpc.__version__}


def _launch_cluster(args: argparse.Namespace):
    from chorus.launcher import Cluster

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    worker = ["--device", args.device, "--dtype", dtype]
    vocoder = ["--device", args.device, "--dtype", dtype]
    scheduler: list[str] = []
    if args.model:
        worker += ["--model", args.model]
        scheduler += ["--tokenizer", args.model]
    if args.codec:
        vocoder += ["--codec", args.codec]
    return Cluster(worker_args=worker + list(args.worker_arg), vocoder_args=vocoder + list(args.vocoder_arg),
                   scheduler_args=scheduler + list(args.scheduler_arg), scheduler_port=0,
                   vocoder_ports=[0] * max(1, args.vocoders), echo=args.server_logs)


def _config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    cfg["seed"] = seed
    cfg["mode"] = "open" if args.rate else "closed"
    cfg["workloads"] = {w: {"frames": args.frames or WORKLOADS[w].frames, "words": WORKLOADS[w].words,
                            "clone": WORKLOADS[w].clone, "description": WORKLOADS[w].description}
                        for w in args.workload}
    return cfg


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark described by `args` (see parse_args); print the
    table, write --out/--plot, and return the results dict (the JSON)."""
    if args.requests is not None and args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    if args.frames is not None and args.frames < 1:
        raise SystemExit("--frames must be >= 1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "finished_at": None,
        "git": git_revision(),
        "device_note": args.device_note,
        "host": _host(),
        "server": {"address": args.server or ("launched" if args.launch else "127.0.0.1:50051"),
                   "launched": bool(args.launch), "models": []},
        "config": _config(args, seed),
        "complete": False,
        "levels": [],
        "records": [],
    }
    cluster = None
    try:
        if args.launch:
            print("starting worker, vocoder and scheduler ...", file=sys.stderr, flush=True)
            cluster = _launch_cluster(args).start()
            address = cluster.address
            results["server"]["launch_args"] = {"worker": cluster.worker_args, "vocoder": cluster.vocoder_args,
                                                "scheduler": cluster.scheduler_args}
        else:
            address = args.server or "127.0.0.1:50051"
        results["server"]["address"] = address
        asyncio.run(_run_levels(args, address, seed, results, cluster.services if cluster is not None else None))
        results["complete"] = True
    except KeyboardInterrupt:
        print("\ninterrupted; writing what was measured", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.stop()
        results["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {args.out}", file=sys.stderr)
        if args.plot and results["levels"]:
            plot(results, args.plot)
    return results


def plot(results: dict[str, Any], path: str) -> bool:
    """Throughput and TTFA p50/p99 against concurrency (or offered rate), one
    line per workload. Returns False (with a warning) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed, skipping the plot (pip install -e '.[bench]')",
              file=sys.stderr)
        return False
    levels = results["levels"]
    open_loop = any(lv["mode"] == "open" for lv in levels)
    xkey, xlabel = ("rate", "offered load (req/s)") if open_loop else ("concurrency", "concurrent streams")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for w in dict.fromkeys(lv["workload"] for lv in levels):
        pts = sorted((lv[xkey], lv) for lv in levels if lv["workload"] == w)
        xs = [x for x, _ in pts]
        ax1.plot(xs, [lv["audio_s_per_s"] for _, lv in pts], "o-", label=w)
        line, = ax2.plot(xs, [lv["ttfa_ms"]["p50"] for _, lv in pts], "o-", label=f"{w} p50")
        ax2.plot(xs, [lv["ttfa_ms"]["p99"] for _, lv in pts], "s--", color=line.get_color(), label=f"{w} p99")
    ticks = sorted({lv[xkey] for lv in levels})
    for ax in (ax1, ax2):
        ax.set_xlabel(xlabel)
        if not open_loop:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("audio seconds / second")
    ax1.set_title("throughput")
    ax1.set_ylim(bottom=0)
    ax2.set_ylabel("ms")
    ax2.set_title("time to first audio")
    ax2.set_ylim(bottom=0)
    git = results.get("git") or {}
    rev = git.get("revision")
    rev = f"rev {rev[:10]}{' (dirty)' if git.get('dirty') else ''}" if rev else None
    title = " | ".join(x for x in ("chorus bench", results.get("device_note"), rev) if x)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return True


if __name__ == "__main__":
    a = parse_args()
    cmd_bench(a)

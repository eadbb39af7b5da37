"""chorus bench's load generator: one asyncio gRPC client driving a level of
closed-loop streams or open-loop Poisson arrivals, and its progress bar."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from chorus.bench.workloads import OMNIVOICE_FRAME_RATE, WORKLOADS, Workload, make_text

OMNIVOICE = "omnivoice"

@dataclass
class Level:
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


class Runner:
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
        self.omnivoice_model: str | None = None
        self.stored_voices: list[str] = []   # O2: voice ids created through CreateVoice

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
        workloads = [WORKLOADS[w] for w in self.args.workload]
        if any(w.omnivoice for w in workloads):
            self.omnivoice_model = next((m["name"] for m in self.models if m["architecture"] == OMNIVOICE), None)
            if self.omnivoice_model is None:
                raise SystemExit(f"workloads {', '.join(w.name for w in workloads if w.omnivoice)} need an OmniVoice "
                                 f"model; the server serves {[m['name'] for m in self.models]} (launch with "
                                 "cluster.omnivoice, e.g. --layout o1-1gpu)")
        if any(w.omnivoice and w.clone for w in workloads):
            await self._store_voices()

    async def _store_voices(self) -> None:
        """--voices voices of 5 s of seeded noise, encoded by the OmniVoice model's codec and stored
        under ids of this run (deleted again by close)."""
        import grpc
        import numpy as np

        from chorus.v1 import common_pb2, tts_pb2

        rate = next(m["sample_rate"] for m in self.models if m["name"] == self.omnivoice_model)
        for v in range(self.args.voices):
            rng = np.random.default_rng([self.seed, 104729, v])
            pcm = (rng.standard_normal(5 * rate) * 3000).clip(-32767, 32767).astype("<i2")
            request = tts_pb2.CreateVoiceRequest(
                voice_id=f"bench-{self.seed}-{v}", model=self.omnivoice_model,
                transcript="A stored voice the benchmark clones.",
                audio=common_pb2.AudioData(data=pcm.tobytes(), encoding=common_pb2.AUDIO_ENCODING_PCM16,
                                           sample_rate=rate, channels=1))
            try:
                voice = await self.stubs[0].CreateVoice(request, timeout=120)
            except grpc.aio.AioRpcError as e:  # voices persist: a run that never closed left it
                if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                await self.stubs[0].DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id=request.voice_id), timeout=30)
                voice = await self.stubs[0].CreateVoice(request, timeout=120)
            self.stored_voices.append(voice.voice_id)

    async def close(self) -> None:
        from chorus.v1 import tts_pb2

        for voice_id in self.stored_voices:
            try:
                await self.stubs[0].DeleteVoice(tts_pb2.DeleteVoiceRequest(voice_id=voice_id), timeout=30)
            except Exception:  # noqa: BLE001 - a voice left behind is harmless
                pass
        for c in self.channels:
            await c.close()

    def _request(self, wl: Workload, k: int):
        from chorus.v1 import tts_pb2

        rng = random.Random(f"{self.seed}/{k}")
        if wl.omnivoice:
            return self._omnivoice_request(wl, k, rng)
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

    def _omnivoice_request(self, wl: Workload, k: int, rng: random.Random):
        """An OmniVoice request: its length as duration_seconds, its knobs drawn from the workload's."""
        from chorus.v1 import tts_pb2

        seconds = self.args.frames / OMNIVOICE_FRAME_RATE if self.args.frames else wl.seconds
        req = tts_pb2.SynthesizeRequest(
            text=make_text(rng, wl.words), model=self.omnivoice_model, language=self.args.language,
            duration_seconds=seconds, format=tts_pb2.PCM16, sample_rate=self.args.sample_rate,
            request_id=f"bench-{self.seed}-{k}")
        req.sampling.seed = (self.seed + k) % (1 << 64)
        req.omnivoice.num_step, req.omnivoice.guidance_scale = rng.choice(wl.knobs)
        if self.args.num_step:
            req.omnivoice.num_step = self.args.num_step
        voice = None
        if wl.clone and self.stored_voices:
            voice = rng.randrange(len(self.stored_voices))
            req.references.append(tts_pb2.VoiceReference(voice_id=self.stored_voices[voice]))
        return req, voice

    async def one(self, level: Level, measured: bool) -> None:
        import grpc

        k = self.counter
        self.counter += 1
        req, voice = self._request(level.workload, k)
        rec: dict[str, Any] = {
            "level": None, "workload": level.workload.name, "mode": level.mode,
            "concurrency": int(level.value) if level.mode == "closed" else None,
            "rate": level.value if level.mode == "open" else None,
            "index": k, "seed": req.sampling.seed, "voice": voice, "measured": measured,
            "frames_requested": req.max_frames or round(req.duration_seconds * OMNIVOICE_FRAME_RATE),
            "num_step": req.omnivoice.num_step if level.workload.omnivoice else None,
            "guidance_scale": req.omnivoice.guidance_scale if level.workload.omnivoice else None,
            "error": None,
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
            "server_first_frame_ms": summary.first_frame_ms if summary else None,
            "server_first_chunk_frames_ms": summary.first_chunk_frames_ms if summary else None,
            "server_total_ms": summary.total_ms if summary else None,
            "server_last_frame_ms": summary.last_frame_ms if summary else None,
            "server_max_audio_lag_ms": summary.max_audio_lag_ms if summary else None,
            "sample_rate": sr,
            "samples_per_frame": header.samples_per_frame if header else 0,
            "_chunks": chunks,
        })
        level.records.append(rec)

    async def closed_level(self, level: Level) -> None:
        async def stream() -> None:
            while True:
                now = self.now()
                if not level.may_issue(now):
                    break
                measured = now >= level.t_warm
                level.issued_measured += measured
                await self.one(level, measured)

        await asyncio.gather(*(stream() for _ in range(int(level.value))))

    async def open_level(self, level: Level) -> None:
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


class Progress:
    """A one-line text progress bar on stderr."""

    WIDTH = 28

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_plain = 0.0

    def draw(self, runner: Runner, level: Level, final: bool = False) -> None:
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

    async def run(self, runner: Runner, level: Level) -> None:
        try:
            while True:
                self.draw(runner, level)
                await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            self.draw(runner, level, final=True)
            raise

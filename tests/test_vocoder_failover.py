"""Vocoder replicas and failover, end to end: two vocoder replicas behind one
scheduler; one is SIGKILLed while three seeded requests stream from it, and
every client still gets audio byte-identical to a fault-free run."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import soundfile as sf

from chorus.client import channel, synthesize
from chorus.v1 import common_pb2, tts_pb2, tts_pb2_grpc, vocoder_pb2, vocoder_pb2_grpc
from scheduler_svc.audio_relay import AudioRelay, SynthesisFailed
from scheduler_svc.output import AudioOutput
from scheduler_svc.request import FinishEvent, FrameEvent, Request
from scheduler_svc.vocoder_client import VocoderPool, format_address, parse_target, resolve
from vocoder_svc.codec import tiny_v2
from vocoder_svc.codec_checkpoint import build_codec
from vocoder_svc.servicer import VocoderServicer

from helpers import free_port, make_cluster, metric

FRAMES = 150  # ~3 s of generation on two CPU cores: room to kill a replica mid-stream
SEEDS = (11, 12, 13)
SAMPLES_PER_FRAME = 3840
FAILOVER_LOG = re.compile(r"vocoder stream on (\S+) broke .* replaying (\d+) frames on (\S+)")


def request(seed: int, frames: int = FRAMES) -> tts_pb2.SynthesizeRequest:
    req = tts_pb2.SynthesizeRequest(text=f"Replica failover, request {seed}.", language="English",
                                    min_frames=frames, max_frames=frames)
    req.sampling.seed = seed
    req.streaming.first_chunk_frames = 5
    req.streaming.chunk_frames = 10
    return req


@pytest.fixture(scope="module")
def replicas():
    c = make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                     scheduler_args=["--max-queue", "16"], vocoder_ports=[0, 0])
    with c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        synthesize(stub, request(1, frames=3), timeout=120)  # warm-up
        yield c, stub


def active_streams(service) -> int:
    stub = vocoder_pb2_grpc.VocoderStub(channel(service.address))
    return stub.Info(vocoder_pb2.VocoderInfoRequest(), timeout=5).active_streams


def run_three(stub, on_all_started=None, min_chunks: int = 2):
    """The three seeded requests at once; on_all_started(progress) runs once every client has
    min_chunks audio chunks (with 5 + 10 frames: 15 frames of its 150)."""
    progress: dict[int, int] = {}  # seed -> samples received
    lock = threading.Lock()
    fired = threading.Event()

    def on_chunk(seed):
        def cb(synthesis):
            with lock:
                if len(synthesis.chunks) >= min_chunks:
                    progress[seed] = sum(c.num_samples for c in synthesis.chunks)
                ready = len(progress) == len(SEEDS) and not fired.is_set()
                if ready:
                    fired.set()
                    snapshot = dict(progress)
            if ready and on_all_started is not None:
                on_all_started(snapshot)
        return cb

    with ThreadPoolExecutor(len(SEEDS)) as pool:
        futures = [pool.submit(synthesize, stub, request(s), 120, on_chunk(s)) for s in SEEDS]
        return [f.result() for f in futures]


def check_complete(results) -> None:
    for r in results:
        assert r.summary is not None and r.summary.frames == FRAMES
        assert r.summary.finish_reason == tts_pb2.MAX_FRAMES
        assert r.pcm().shape == (FRAMES * SAMPLES_PER_FRAME, 2)
        starts = [c.first_sample for c in r.chunks]
        sizes = [c.num_samples for c in r.chunks]
        assert starts == list(np.cumsum([0] + sizes[:-1])), "chunks must tile the audio without gaps or overlap"


@pytest.fixture(scope="module")
def fault_free(replicas):
    _, stub = replicas
    results = run_three(stub)
    check_complete(results)
    assert len({r.audio_bytes for r in results}) == len(SEEDS)  # different seeds, different audio
    return results


def test_sigkill_mid_stream_is_byte_identical(replicas, fault_free):
    cluster, stub = replicas
    vocoders = [cluster.service("vocoder0"), cluster.service("vocoder1")]
    killed = {}

    def kill_busiest(progress):
        counts = [active_streams(v) for v in vocoders]
        victim = vocoders[int(np.argmax(counts))]
        killed.update(service=victim, streams=max(counts), progress=progress)
        victim.proc.kill()  # SIGKILL: no drain, its streams die mid-chunk

    results = run_three(stub, on_all_started=kill_busiest)
    assert killed, "the clients never received audio"
    assert killed["streams"] >= 1, "the killed replica was serving no stream"
    assert killed["service"].proc.wait(5) != 0
    # Mid-stream: every client had its first audio and none had all of it.
    assert all(0 < n < FRAMES * SAMPLES_PER_FRAME for n in killed["progress"].values()), killed["progress"]

    check_complete(results)
    for got, want in zip(results, fault_free):
        assert got.audio_bytes == want.audio_bytes

    dead = killed["service"].address
    failovers = [m.groups() for line in cluster.service("scheduler").lines if (m := FAILOVER_LOG.search(line))]
    print("failovers:", failovers, "kill at", killed["progress"])
    assert failovers, "no stream failed over"
    assert all(src == dead and dst != dead for src, _, dst in failovers), failovers
    assert len(failovers) == killed["streams"], failovers  # every stream on it moved exactly once
    survivor = next(v for v in vocoders if v is not killed["service"])
    deadline = time.monotonic() + 20
    while (metric(cluster, "chorus_running_requests"), metric(cluster, "chorus_kv_slots_used"),
           active_streams(survivor)) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (metric(cluster, "chorus_running_requests"), metric(cluster, "chorus_kv_slots_used"),
            active_streams(survivor)) == (0, 0, 0)


def test_new_requests_go_to_the_survivor(replicas, fault_free):
    cluster, stub = replicas
    dead = [s for s in (cluster.service("vocoder0"), cluster.service("vocoder1")) if s.proc.poll() is not None]
    if not dead:  # run on its own: kill one replica, and let one request discover it
        cluster.service("vocoder0").proc.kill()
        cluster.service("vocoder0").proc.wait(5)
        dead = [cluster.service("vocoder0")]
        assert synthesize(stub, request(5, frames=12), timeout=60).summary.frames == 12
    survivor = next(s for s in (cluster.service("vocoder0"), cluster.service("vocoder1")) if s not in dead)
    before = sum(1 for line in cluster.service("scheduler").lines if FAILOVER_LOG.search(line))
    results = run_three(stub)
    check_complete(results)
    for got, want in zip(results, fault_free):
        assert got.audio_bytes == want.audio_bytes
    after = [m.groups() for line in cluster.service("scheduler").lines if (m := FAILOVER_LOG.search(line))]
    # The dead replica is marked unhealthy (and its Info probes keep failing): nothing is sent to it.
    assert after[before:] == [], after[before:]
    assert active_streams(survivor) == 0
    # a short request after that: straight to the survivor, no failover
    before = len(after)
    assert synthesize(stub, request(5, frames=4), timeout=60).summary.frames == 4
    assert sum(1 for line in cluster.service("scheduler").lines if FAILOVER_LOG.search(line)) == before


def test_all_replicas_down_is_unavailable(replicas):
    """Run last: with every replica dead the request fails fast with a clear UNAVAILABLE."""
    cluster, stub = replicas
    for s in (cluster.service("vocoder0"), cluster.service("vocoder1")):
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(5)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        synthesize(stub, request(7, frames=20), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "vocoder" in e.value.details()
    assert time.monotonic() - t0 < 30


# ---- the pool on its own (no processes) ------------------------------------------------------------

def test_parse_dns_targets():
    assert parse_target("10.0.0.1:50053") is None
    assert parse_target("dns:///vocoder.chorus.svc:50053") == ("dns", "vocoder.chorus.svc", 50053)
    assert parse_target("dns://8.8.8.8/vocoder:7000") == ("dns", "vocoder", 7000)
    assert parse_target("dns:///[::1]:9") == ("dns", "::1", 9)
    assert format_address("::1", 9) == "[::1]:9" and format_address("10.0.0.2", 9) == "10.0.0.2:9"
    with pytest.raises(ValueError):
        parse_target("dns:///vocoder:http")


def test_pool_health_pick_and_dns_refresh():
    records = {"vocoder": ["10.0.0.1:50053", "10.0.0.2:50053"]}

    async def main():
        pool = VocoderPool(["dns:///vocoder:50053", "127.0.0.1:1"], cooldown=0.3, probe_interval=3600,
                           resolver=lambda host, port: list(records[host]))
        try:
            a, b, c = pool.replicas
            assert [r.address for r in pool.replicas] == ["10.0.0.1:50053", "10.0.0.2:50053", "127.0.0.1:1"]
            # least loaded, ties to the first listed
            assert pool.pick() is a
            pool.acquire(a)
            assert pool.pick() is b
            pool.acquire(b)
            pool.acquire(c)
            assert pool.pick() is a
            # an unhealthy replica is skipped until its cooldown passes (or a probe brings it back)
            pool.mark_failed(a, "test")
            pool.release(b)
            assert pool.pick() is b
            pool.acquire(b)
            pool.acquire(b)
            assert pool.pick() is c  # a (1 stream) is cooling down; c has 1, b has 2
            await asyncio.sleep(0.35)
            assert pool.pick() is a and a.available()
            pool.mark_healthy(a)
            # everything down: the one that comes back first
            for r, t in ((a, 0.3), (b, 0.1), (c, 0.2)):
                pool.mark_failed(r, "down")
                r.retry_after = time.monotonic() + t
            assert pool.pick() is b
            assert pool.pick(exclude=[b]) is c
            # DNS: a new record adds a replica; a vanished one retires (kept until its streams end)
            records["vocoder"] = ["10.0.0.2:50053", "10.0.0.3:50053"]
            await pool.refresh()
            assert [r.address for r in pool.replicas] == ["10.0.0.2:50053", "127.0.0.1:1", "10.0.0.3:50053"]
            assert a.retired and not a.available()
            pool.release(a)
            assert a not in pool._retired
            # a failed resolution keeps what the pool has
            records.pop("vocoder")
            pool._resolver = lambda host, port: (_ for _ in ()).throw(OSError("no such host"))
            await pool.refresh()
            assert len(pool.replicas) == 3
        finally:
            await pool.close()
        assert "127.0.0.1:50053" in resolve("127.0.0.1", 50053)

    asyncio.run(main())


def test_pool_info_and_encode_fail_over():
    """Info waits for the first replica that answers; Encode moves past a dead replica."""

    async def main():
        server = grpc.aio.server()
        servicer = VocoderServicer(build_codec(tiny_v2(), seed=0), "tiny", max_batch_streams=1)
        vocoder_pb2_grpc.add_VocoderServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        dead = f"127.0.0.1:{free_port()}"
        pool = VocoderPool([dead, f"127.0.0.1:{port}"], probe_interval=3600)
        try:
            info = await pool.info(timeout=20)
            assert info.sample_rate == 48000 and pool.replicas[1].healthy
            pool.replicas[1].open_streams = 5  # the dead one looks least loaded
            buf = io.BytesIO()
            sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * np.arange(48000) / 48000), 48000, format="WAV")
            req = vocoder_pb2.EncodeRequest(codebooks=12, audio=common_pb2.AudioData(data=buf.getvalue()))
            resp = await pool.encode(req, timeout=30)
            assert resp.codes.rows == 12
            assert not pool.replicas[0].healthy and pool.replicas[1].healthy
            assert await pool.probe(pool.replicas[0]) is False  # still down: it stays out
            assert not pool.replicas[0].healthy and pool.pick() is pool.replicas[1]
            assert await pool.probe(pool.replicas[1]) and pool.replicas[1].verified
        finally:
            await pool.close()
            await server.stop(0)
            servicer.close()

    asyncio.run(main())



def test_pool_takes_the_chunk_defaults_from_info_and_reports_replicas_that_disagree(caplog):
    """The pool's chunk defaults are the first replica's Info; a replica announcing others still
    serves (every DecodeStart names its sizes) and is reported once, by address and values."""

    async def main():
        codec = build_codec(tiny_v2(), seed=0)
        ours = VocoderServicer(codec, "tiny", first_chunk_frames=3, chunk_frames=7, max_batch_streams=1)
        other = VocoderServicer(codec, "tiny", first_chunk_frames=5, chunk_frames=25, max_batch_streams=1)
        (s1, a1), (s2, a2) = await _serve(ours), await _serve(other)
        pool = VocoderPool([a1, a2], probe_interval=3600)
        try:
            assert await pool.probe(pool.replicas[0]) and pool.chunks == (3, 7)
            with caplog.at_level("WARNING", logger="chorus.scheduler"):
                assert await pool.probe(pool.replicas[1]) and await pool.probe(pool.replicas[1])
            said = [r.getMessage() for r in caplog.records if "chunk" in r.getMessage()]
            assert len(said) == 1 and a2 in said[0] and "first chunk 5, chunk 25" in said[0]
            assert "first chunk 3, chunk 7" in said[0]
            assert pool.chunks == (3, 7) and not pool.replicas[1].incompatible
        finally:
            await pool.close()
            for server, servicer in ((s1, ours), (s2, other)):
                await server.stop(0)
                servicer.close()

    asyncio.run(main())



# ---- the relay in-process: injected faults, resampled output ---------------------------------------

class FaultyVocoder(VocoderServicer):
    """A real vocoder whose Decode streams die (or hang) after `after` chunks while `fault` is set."""

    def __init__(self, fault: str | None = None, after: int = 2):
        super().__init__(build_codec(tiny_v2(), seed=0), "tiny", first_chunk_frames=5, chunk_frames=10)
        self.fault, self.after, self.opened = fault, after, 0

    async def Decode(self, request_iterator, context):
        self.opened += 1
        sent = 0
        async for resp in super().Decode(request_iterator, context):
            if self.fault and sent == self.after:
                if self.fault == "hang":
                    await asyncio.sleep(3600)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected replica failure")
            yield resp
            sent += 1


async def _serve(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    vocoder_pb2_grpc.add_VocoderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _relay_run(pool, codec, frames, *, rate=48000, fmt=tts_pb2.PCM16, return_codes=False,
                     stall_timeout=30.0, gap=0.002):
    """Feed `frames` code rows through AudioRelay as the scheduler would; (audio bytes, codes chunks)."""
    relay = AudioRelay(pool, codec, 12, stall_timeout=stall_timeout)
    req = Request(prompt_rows=np.zeros((1, 13), np.int32), sampling=None, max_frames=len(frames))

    async def produce():
        for i, row in enumerate(frames):
            req.frames.append(row)
            req.events.put_nowait(FrameEvent(i, row))
            await asyncio.sleep(gap)
        req.events.put_nowait(FinishEvent("max_frames"))

    producer = asyncio.create_task(produce())
    audio, codes = [], []
    try:
        async for item in relay.stream(req, AudioOutput(48000, 2, rate, fmt), 5, 10, return_codes):
            if item.HasField("audio"):
                assert item.audio.first_sample == sum(a.num_samples for a in audio)
                audio.append(item.audio)
            else:
                codes.append(item.codes)
    finally:
        producer.cancel()
    return b"".join(a.data for a in audio), codes


def _frames(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [np.concatenate([[0], rng.integers(0, 1024, 12)]).astype(np.int32) for _ in range(n)]


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_relay_failover_resumes_at_the_exact_sample(fault):
    """The first replica breaks after 2 chunks (error, or silence caught by the stall watchdog); the
    client's resampled float32 audio and its code chunks equal a fault-free run."""
    frames = _frames()

    async def main():
        bad, good = FaultyVocoder(fault), FaultyVocoder()
        servers = [await _serve(bad), await _serve(good)]
        pool = VocoderPool([servers[0][1], servers[1][1]], probe_interval=3600)
        try:
            codec = await pool.info(timeout=10)
            kw = dict(rate=16000, fmt=tts_pb2.FLOAT32, return_codes=True, stall_timeout=2.0)
            bad.fault = None
            want = await _relay_run(pool, codec, frames, **kw)
            bad.fault = fault
            t0 = time.monotonic()
            got = await _relay_run(pool, codec, frames, **kw)
            assert got[0] == want[0] and len(got[0]) == len(frames) * 1280 * 2 * 4
            assert [c.first_frame for c in got[1]] == list(range(len(frames)))  # codes: once each
            assert bad.opened == 2 and good.opened == 1  # fault-free run on bad; then bad -> good
            assert not pool.replicas[0].healthy
            assert time.monotonic() - t0 < 10
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(main())


def test_relay_gives_up_after_max_failovers_and_does_not_retry_bad_requests():
    async def main():
        vocoders = [FaultyVocoder("crash", after=0), FaultyVocoder("crash", after=1)]
        servers = [await _serve(v) for v in vocoders]
        pool = VocoderPool([a for _, a in servers], cooldown=0.05, probe_interval=3600)
        try:
            codec = await pool.info(timeout=10)
            with pytest.raises(SynthesisFailed) as e:
                await _relay_run(pool, codec, _frames(30))
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert "giving up after 3 failovers" in str(e.value)
            assert sum(v.opened for v in vocoders) == 4
            # A stream the vocoder rejects (a code outside the codebook) is not retried elsewhere.
            for v in vocoders:
                v.fault, v.opened = None, 0
            for r in pool.replicas:
                pool.mark_healthy(r)
            bad = _frames(8)
            bad[6][3] = 5000
            with pytest.raises(SynthesisFailed) as e:
                await _relay_run(pool, codec, bad)
            assert e.value.code == grpc.StatusCode.INTERNAL and "rejected" in str(e.value)
            assert sum(v.opened for v in vocoders) == 1
            assert all(r.open_streams == 0 for r in pool.replicas)
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(main())


def test_decode_process_death_fails_over_byte_identical():
    """Vocoders running their slot decoder in a decode process (one bucket, so any replica gives the same
    bytes): SIGKILL of one replica's decode process mid-stream ends its calls UNAVAILABLE, the
    scheduler replays them on the other replica, every client's audio is byte-identical to the
    fault-free run, and the replica whose decoder died exits non-zero."""
    from chorus.processes import child_pids

    slots_args = ["--engine", "slots", "--slots", "4", "--buckets", "4", "--graphs", "off"]
    c = make_cluster(worker_args=["--dtype", "float32", "--max-batch", "8", "--kv-slots", "16384"],
                     scheduler_args=["--max-queue", "16"], vocoder_ports=[0, 0], vocoder_args=slots_args)
    with c:
        stub = tts_pb2_grpc.TextToSpeechStub(channel(c.address))
        synthesize(stub, request(1, frames=3), timeout=120)  # warm-up
        want = run_three(stub)
        check_complete(want)
        vocoders = [c.service("vocoder0"), c.service("vocoder1")]
        killed = {}

        def kill_busiest_decoder(progress):
            counts = [active_streams(v) for v in vocoders]
            victim = vocoders[int(np.argmax(counts))]
            (decoder,) = child_pids(victim.proc.pid)
            killed.update(service=victim, streams=max(counts), progress=progress)
            os.kill(decoder, signal.SIGKILL)

        got = run_three(stub, on_all_started=kill_busiest_decoder)
        assert killed and killed["streams"] >= 1
        check_complete(got)
        assert [r.audio_bytes for r in got] == [r.audio_bytes for r in want]
        assert killed["service"].proc.wait(20) != 0
        failovers = [m.groups() for line in c.service("scheduler").lines if (m := FAILOVER_LOG.search(line))]
        assert len(failovers) == killed["streams"], failovers

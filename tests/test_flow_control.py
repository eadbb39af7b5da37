"""A client that stops reading (real processes, tiny model): its frontend holds a bounded amount of
its audio (RSS measured), its request stops being scheduled, and after the reader stall the stream
ends with a status that says why; nothing stays held."""

import time

import grpc

from chorus.v1 import tts_pb2, tts_pb2_grpc
from helpers import make_cluster, metric, seeded_request, wait_until_idle

STALL_S = 4


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _frontend_pid(core_pid: int) -> int:
    with open(f"/proc/{core_pid}/task/{core_pid}/children") as f:
        return int(f.read().split()[0])


def test_a_client_that_stops_reading_is_bounded_paused_and_cancelled():
    args = ["--max-stream-buffer-bytes", str(1 << 20), "--reader-stall-s", str(STALL_S)]
    with make_cluster(["--dtype", "float64"], args) as c:
        frontend = _frontend_pid(c.service("scheduler").proc.pid)
        # without BDP probing the client's HTTP/2 window stays at its default: what the client's gRPC
        # takes in while the application reads nothing does not depend on how busy the machine is
        stub = tts_pb2_grpc.TextToSpeechStub(grpc.insecure_channel(c.address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.http2.bdp_probe", 0)]))
        # 123 KB of audio a frame: 2,000 frames would be 246 MB held if nothing pushed back
        req = seeded_request(frames=2000, format=tts_pb2.FLOAT32, sample_rate=192000)
        assert sum(1 for _ in stub.Synthesize(seeded_request(frames=3), timeout=60)) > 0  # warm
        before = _rss_mb(frontend)
        call = stub.Synthesize(req, timeout=30)
        assert next(call).HasField("header")
        t0 = time.monotonic()
        time.sleep(STALL_S - 1)
        frames_paused = metric(c, "chorus_frames_generated_total")
        during = _rss_mb(frontend)
        time.sleep(1.5)
        assert metric(c, "chorus_frames_generated_total") - frames_paused < 100, "the stalled request kept decoding"
        time.sleep(STALL_S + 1)
        got, status = 0, None
        try:
            for resp in call:  # what gRPC had already taken, then the status
                got += len(resp.audio.data)
        except grpc.RpcError as e:
            status = e
        after = _rss_mb(frontend)
        assert status is not None, f"the stream finished ({got} bytes) instead of being cancelled"
        assert status.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), status
        assert got < 16 << 20 and during - before < 48 and after - before < 48, (got, before, during, after)
        print(f"slow reader: RSS {before:.0f} -> {during:.0f} -> {after:.0f} MB, {got >> 20} MB delivered, "
              f"{status.code().name} after {time.monotonic() - t0:.1f} s: {status.details()}")
        assert wait_until_idle(c) == (0, 0, 0, 0)


def test_backlog_pauses_over_its_share_resumes_on_delivery_and_gives_up_after_the_stall():
    import asyncio

    import pytest

    from scheduler_svc.flow_control import Backlog, ReaderStalled

    async def main():
        backlog = Backlog(per_stream=100, per_frontend=150, stall=0.5)
        calls = []
        a, b = backlog.stream(calls.append), backlog.stream()
        a.add(100)
        await asyncio.wait_for(a.room(), 0.1)  # at its share, not over: no pause
        a.add(1)
        waiting = asyncio.ensure_future(a.room())
        await asyncio.sleep(0.05)
        assert not waiting.done() and calls == [True]
        a.delivered(50)
        await asyncio.wait_for(waiting, 1)
        assert calls == [True, False]
        b.add(100)  # the frontend is over 150: both hold some, both wait; one holding none would not
        assert a.full() and b.full() and not backlog.stream().full()
        with pytest.raises(ReaderStalled, match="reader_stall"):
            await asyncio.wait_for(b.room(), 2)
        b.close()
        a.close()
        assert backlog.total == 0 and not a.full()

    asyncio.run(main())

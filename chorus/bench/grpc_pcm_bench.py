"""What one PCM chunk costs gRPC Python: a server streams 384 KB DecodeResponses (25 frames of
48 kHz stereo PCM16, the vocoder's steady chunk) to concurrent Decode calls on loopback; reports
CPU per message on each side.

Both the vocoder and the scheduler's frontends move every chunk through this path, so it bounds
their audio-s/s per core.

    python -m chorus.bench.grpc_pcm_bench --out grpc_pcm_bench_cpu.json
    python -m chorus.bench.grpc_pcm_bench --client-option grpc.http2.max_frame_size=4194304
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import time

import grpc

from chorus.bench.common import write_json
from chorus.processes import process_cpu_seconds
from chorus.v1 import vocoder_pb2, vocoder_pb2_grpc

CHUNK_BYTES = 25 * 3840 * 2 * 2  # 25 frames x 3840 samples x 2 channels x int16


class _Streamer(vocoder_pb2_grpc.VocoderServicer):
    def __init__(self):
        self.pcm = os.urandom(CHUNK_BYTES)

    async def Decode(self, request_iterator, context):
        async for req in request_iterator:
            if req.end:
                break
            yield vocoder_pb2.DecodeResponse(pcm=self.pcm, num_samples=CHUNK_BYTES // 4)


def _serve(port_q: mp.Queue) -> None:
    async def main():
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        vocoder_pb2_grpc.add_VocoderServicer_to_server(_Streamer(), server)
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


async def _drive(port: int, options: list, streams: int, per_stream: int) -> tuple[float, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options + [
            ("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = vocoder_pb2_grpc.VocoderStub(ch)

        async def one() -> int:
            async def requests():
                for _ in range(per_stream):
                    yield vocoder_pb2.DecodeRequest(start=vocoder_pb2.DecodeStart())  # one chunk each
                yield vocoder_pb2.DecodeRequest(end=True)
            return sum([1 async for _ in stub.Decode(requests())])

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one() for _ in range(streams)))
        return time.perf_counter() - t0, sum(got)


def _option(text: str) -> tuple[str, int | str]:
    name, _, value = text.partition("=")
    return name, int(value) if value.lstrip("-").isdigit() else value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16, help="concurrent Decode calls")
    ap.add_argument("--messages", type=int, default=1500, help="messages in all, over the streams")
    ap.add_argument("--repeats", type=int, default=3, help="runs, each timed on its own")
    ap.add_argument("--client-option", action="append", default=[], metavar="NAME=VALUE",
                    help="gRPC channel option of the receiving side")
    ap.add_argument("--out", metavar="JSON", help="write the results here")
    args = ap.parse_args()
    options = [_option(o) for o in args.client_option]
    q: mp.Queue = mp.Queue()
    server = mp.Process(target=_serve, args=(q,), daemon=True)
    server.start()
    port = q.get()
    runs = []
    try:
        for _ in range(args.repeats):
            s0, u0 = process_cpu_seconds(server.pid), resource.getrusage(resource.RUSAGE_SELF)
            wall, n = asyncio.run(_drive(port, options, args.streams, args.messages // args.streams))
            s1, u1 = process_cpu_seconds(server.pid), resource.getrusage(resource.RUSAGE_SELF)
            client = (u1.ru_utime + u1.ru_stime) - (u0.ru_utime + u0.ru_stime)
            r = {"messages": n, "wall_s": wall, "mb_per_s": n * CHUNK_BYTES / wall / 1e6,
                 "sender_us_per_message": 1e6 * (s1 - s0) / n, "receiver_us_per_message": 1e6 * client / n}
            runs.append(r)
            print(f"{n} x {CHUNK_BYTES // 1000} KB in {wall:.2f}s ({r['mb_per_s']:.0f} MB/s): sender "
                  f"{r['sender_us_per_message']:.0f} us, receiver {r['receiver_us_per_message']:.0f} us of CPU "
                  f"per message", flush=True)
    finally:
        server.terminate()
    write_json(args.out, {"benchmark": "grpc_pcm", "grpc": grpc.__version__, "cpus": os.cpu_count(),
                          "config": vars(args), "runs": runs})


if __name__ == "__main__":
    main()

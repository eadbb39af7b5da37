"""The vocoder gRPC service (chorus.v1.Vocoder): streaming Decode of code
frames to PCM, Encode of reference audio to codes, Info.

Chunking is a pure function of (first_chunk_frames, chunk_frames, total
frames): the first chunk is exactly first_chunk_frames frames, every later
one exactly chunk_frames, and `end` flushes whatever remains. Arrival timing
never matters, so the PCM is byte-identical run to run (with the slots
engine on GPU only within one bucket: see below).

Codec work runs on worker threads, never on the asyncio loop. Two decode
engines (--engine; auto = slots on CUDA devices, stream otherwise):

Stream engine (the CPU default). Each call owns a StreamState. Steps of
different streams that are due together with the same frame count are
decoded in one batched forward (up to --max-batch-streams). By default the
batch is batch-invariant (`--batch-mode invariant`): every GEMM runs per
stream inside one bmm and the codebook sum has a fixed order, so a stream's
PCM is bit-identical whatever else shares its step, and a stream replayed on
another replica (scheduler failover) reproduces the same bytes. Startup
checks this on the serving device and dtype (a solo stream against the same
stream batched with others); if the check fails (e.g. --torch-threads > 1
on CPU, where MKL splits a lone GEMM across threads) the service falls back
to one stream per step and says so. `--batch-mode fast` folds the batch into
plain GEMMs: a few percent faster, but a stream's output then moves at the
~1e-6 level with whichever streams happened to be due together.

Slots engine (the CUDA default). A SlotDecoder (vocoder_svc/slot_decoder.py)
holds the streaming state of up to --slots streams in preallocated device
buffers. A call takes a slot with its first step and gives it back when it
ends (finish, cancel or error); a step that finds every slot taken waits in
the queue (never an error) until a call ends. The oldest due step and every
other due step with the same frame count are decoded in one decoder step,
padded to the next batch bucket (--buckets); each (bucket, T) with T in
--graph-frames (default: the first and steady chunk sizes) is captured as a
CUDA graph at startup, one progress line each, and replayed; any other T (a
request's own chunk sizes) runs eagerly at the same bucket. A stream's short
last step (the tail flush) is padded to its chunk size and its PCM cut back.
Streams whose start.codebooks is not --slot-codebooks use the stream
engine. Startup prints a self-check of the byte-identity facts below. On
CUDA the slot decoder and its step loop run in a child process
(--decode-process, vocoder_svc/decode_process.py) so that gRPC's threads,
which hold the GIL while they write PCM, never stall the steps; this
process keeps the calls, the chunking, Encode and the metrics.

Byte identity on GPU (slots engine), which matters because the scheduler
replays a broken stream on another replica, where other streams share its
steps, and resumes at the exact sample:
  * holds within one bucket: every op is per row and padding rows are
    scratch rows, so a stream's PCM is bit-identical whoever its neighbours
    are, and graph replay equals eager (H200, bf16: both bitwise);
  * does not hold across buckets: GEMM shapes change with the bucket and
    cuBLAS picks other kernels; on an H200 in bf16 a stream alone (bucket 1)
    differs from the same stream in bucket 4 by up to 0.125 (random full
    codec). The bucket of a step is the number of streams due with the same
    T at that moment, i.e. load and timing, so with several buckets even two
    runs on one replica may differ, and a failover replay continues with
    audio close to, but not byte-identical with, what the failed replica
    would have sent: the CPU stream engine's guarantee does not carry over.
  * one bucket (--buckets equal to --slots) restores it for replicas with the
    same --slots, GPU and software: every step has the same shapes. The cost
    is that every step computes the full bucket whatever the load. H200, full
    codec, bf16, 25-frame steps: 167 ms per step at 64 slots, where one
    stream alone takes 14 ms in bucket 1 (30 ms at 8, 52 ms at 16, 89 ms at
    32); throughput at full load is unchanged, latency at light load is not.
    Per-stream GEMMs (the stream engine's invariant mode) are not a cheap
    alternative here: cuBLAS gives no bitwise guarantee for a bmm across
    batch counts, and one GEMM per stream gives up the batching that makes
    the slot decoder fast.
Streams are limited to SlotDecoder.max_stream_frames frames (positions exact in
fp32: 2184 frames, ~175 s, for MOSS-Audio-Tokenizer v2); a longer stream
fails alone with OUT_OF_RANGE (which the scheduler does not fail over).

    python -m vocoder_svc.server --port 50053 --preset tiny
    python -m vocoder_svc.server --codec DIR --device cuda --dtype bfloat16 --slots 64 --graph-frames 5,25
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from chorus.v1 import vocoder_pb2, vocoder_pb2_grpc
from chorus.watchdog import add_stall_flag
from vocoder_svc.codec_config import DEFAULT_CODEBOOKS
from vocoder_svc.decoder_build import (DTYPES, MAX_CHUNK_FRAMES, build_slot_decoder, first_chunk, make_codec,
                                       resolve_engine, stall_exit_seconds)
from vocoder_svc.decoder_client import HOST_SILENCE_S, DecodeProcess
from vocoder_svc.metrics import Metrics
from vocoder_svc.selfcheck import check_batch_invariance
from vocoder_svc.servicer import VocoderServicer

SERVICE_NAME = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name  # "chorus.v1.Vocoder"
MAX_MESSAGE_BYTES = 64 << 20  # a 100 s 48 kHz stereo float32 reference is ~38 MB


# ---- startup -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50053,
                        help="gRPC port (default: %(default)s; 0 picks a free port and prints it)")
    parser.add_argument("--metrics-port", type=int, default=9103,
                        help="Prometheus /metrics HTTP port on --host (default: %(default)s; 0 disables)")
    parser.add_argument("--codec", metavar="DIR", default=None,
                        help="MOSS-Audio-Tokenizer Hugging Face directory (config.json + safetensors). "
                             "Without it, a random-weight --preset is served")
    parser.add_argument("--preset", choices=("tiny", "full"), default="tiny",
                        help="random-weight codec when --codec is not given: tiny = toy v2 for tests, "
                             "full = full-size v2 shapes with dummy weights (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device where the codec runs: cpu, cuda, cuda:1 "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="codec compute dtype; the quantizer always runs in fp32 (default: %(default)s)")
    parser.add_argument("--first-chunk-frames", type=int, default=5,
                        help="frames in a stream's first PCM chunk, for low first-audio latency; a request's "
                             "start.first_chunk_frames overrides it (default: %(default)s)")
    parser.add_argument("--chunk-frames", type=int, default=25,
                        help="frames in every later PCM chunk (25 = 2 s); a request's start.chunk_frames "
                             "overrides it (default: %(default)s)")
    parser.add_argument("--encode-cache-size", type=int, default=256,
                        help="reference encodings kept in the LRU cache (default: %(default)s; 0 disables)")
    parser.add_argument("--engine", choices=("auto", "slots", "stream"), default="auto",
                        help="decode engine. slots: a SlotDecoder of --slots streams, batched steps replayed "
                             "from CUDA graphs; byte-identical within a batch bucket only (see --buckets). stream: "
                             "per-stream states, batch-invariant batching (--batch-mode), byte-identical whatever "
                             "the batch. auto: slots on CUDA devices, stream otherwise (default: %(default)s)")
    parser.add_argument("--slots", type=int, default=64,
                        help="slots engine: streams decoded concurrently; a stream holds a slot from its first "
                             "step to the end of its call, and a stream that finds none free waits for one "
                             "(default: %(default)s)")
    parser.add_argument("--buckets", default=None, metavar="B,B,...",
                        help="slots engine: batch sizes a step is padded to (the largest >= --slots; default "
                             "1,2,4,8 then every 8 up to --slots). A stream's PCM depends on the bucket its steps ran in (in "
                             "bf16 by up to ~0.1 between buckets 1 and 4 on an H200), so a failover replay on "
                             "another replica is byte-identical only in the same buckets. One bucket (--buckets "
                             "equal to --slots) makes every step the same shape: byte-identical across replicas "
                             "with the same --slots, GPU and software, but every step then costs a full bucket "
                             "(H200, full codec, bf16, 25 frames: 167 ms at 64 streams vs 14 ms for one stream "
                             "alone)")
    parser.add_argument("--graph-frames", default=None, metavar="T,T,...",
                        help="slots engine: step sizes (frames) that get a CUDA graph per bucket, captured at "
                             "startup; other sizes (tails, per-request chunk sizes) run eagerly. Default: "
                             "--first-chunk-frames,--chunk-frames; 'none' disables graphs")
    parser.add_argument("--graphs", choices=("auto", "off", "emulate"), default="auto",
                        help="slots engine: auto = CUDA graphs on CUDA devices; off = always eager; emulate = "
                             "the graph bookkeeping with eager replays (tests the path on CPU) "
                             "(default: %(default)s)")
    parser.add_argument("--decode-process", choices=("auto", "on", "off"), default="auto",
                        help="slots engine: run the SlotDecoder and its step loop in a child process, so the "
                             "decode thread never waits for the GIL that gRPC's threads hold while they write "
                             "PCM (one process tops out near 1,500 s of audio per second on an H200). The child "
                             "holds its own copy of the codec weights. auto = on for CUDA devices "
                             "(default: %(default)s)")
    parser.add_argument("--attach-decoder", default=None, metavar="DIR",
                        help="slots engine: use the decoder that `gpu_worker --host-vocoder-decoder DIR` runs "
                             "in the worker's process instead of starting a decode process. On one GPU the codec "
                             "then shares the worker's CUDA context: the GPU interleaves their kernels (the "
                             "worker's on a high-priority stream) where two processes' contexts take turns in "
                             "time slices. The codec flags (--preset, --slots, ...) go to the worker's "
                             "--vocoder-decoder-args, not here. Or DIR/i of a decoder that `python -m "
                             "vocoder_svc.decode_process --fronts-dir DIR --fronts N` runs on its own, shared by N "
                             "vocoder processes (chorus up --shared-vocoder-decoder)")
    parser.add_argument("--attach-silence-s", type=float, default=HOST_SILENCE_S, metavar="S",
                        help="with --attach-decoder: the decoder is gone (open calls end UNAVAILABLE and the "
                             "service stops, so its pod restarts) after this long without a word from it; it "
                             "sends one each second (default: %(default)s)")
    parser.add_argument("--launch-ahead-streams", type=int, default=1, metavar="N",
                        help="slots engine: launch a step while the previous one still runs on the device "
                             "only if it carries at least N streams. Default 1, every step: with a GPU to "
                             "itself the vocoder then never idles between steps (one H200, 32 streams of "
                             "10-frame chunks: 1,696 s of audio per s, 1,436 stepping one at a time). Beside "
                             "the worker on one GPU, `chorus up` passes half of --slots: below that a new "
                             "stream's first chunk waits behind one running step at most")
    parser.add_argument("--step-frames", type=int, default=0, metavar="N",
                        help="slots engine: decode chunks longer than N frames in N-frame steps (the PCM still "
                             "goes back per chunk). With N = --first-chunk-frames every step has one frame count, "
                             "so new streams' first chunks and other streams' steady chunks share steps instead of "
                             "taking turns in small ones (one H200, codec beside the worker, W1 c16: time to "
                             "first audio p50 89 -> 78 ms, 6%% less audio per second). 0 = one step per chunk "
                             "(default: %(default)s)")
    add_stall_flag(parser, "a launched slot-decoder step (slots engine)")
    parser.add_argument("--priority-first-chunks", action="store_true",
                        help="slots engine on CUDA: replay the first chunk's graphs (--first-chunk-frames) on a "
                             "high-priority CUDA stream from their own memory pool, so a new stream's first chunk "
                             "does not wait for a steady step already on the GPU (time to first audio under load; "
                             "worth 2-3 ms of W1 c16 TTFA on one H200). Steps are told apart by their frame count: "
                             "with --step-frames equal to it, every step runs there (default: off)")
    parser.add_argument("--slot-codebooks", type=int, default=DEFAULT_CODEBOOKS,
                        help="slots engine: codebooks per frame the slot decoder decodes; streams with another "
                             "start.codebooks use the stream engine (default: %(default)s, MOSS-TTS Local)")
    parser.add_argument("--max-batch-streams", type=int, default=8,
                        help="stream engine: decode up to this many streams' steps (same frame count) in one "
                             "forward when they are due together; 1 = one stream per step (default: %(default)s)")
    parser.add_argument("--batch-mode", choices=("invariant", "fast"), default="invariant",
                        help="invariant: per-stream GEMMs, a stream's PCM is byte-identical whatever it is batched "
                             "with (checked at startup; falls back to one stream per step if the device breaks "
                             "it); fast: folded GEMMs, output moves at the ~1e-6 level with the batch "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random --preset weights "
                        "(default: %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="CPU threads for torch ops (default: %(default)s, best for the tiny preset and for GPU "
                             "serving; 0 = torch's default, all cores)")
    parser.add_argument("--switch-interval-ms", type=float, default=0.5,
                        help="the interpreter's GIL switch interval (Python's own default is 5 ms). The decode "
                             "thread takes the GIL many times per step while the gRPC thread writes PCM; each "
                             "wait can last a whole interval (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds open calls get to finish on SIGINT/SIGTERM (default: %(default)s)")


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def use_decode_process(args: argparse.Namespace) -> bool:
    """--decode-process: auto = for the slots engine on CUDA devices."""
    if getattr(args, "attach_decoder", None):
        return True
    if resolve_engine(args.engine, args.device) != "slots" or args.decode_process == "off":
        return False
    return args.decode_process == "on" or torch.device(args.device).type == "cuda"


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    metrics = Metrics()
    engine = resolve_engine(args.engine, args.device)
    decoder = failure = None
    if use_decode_process(args):
        def decoder_exited(reason: str) -> None:
            nonlocal failure
            failure = reason
            print(f"vocoder: {reason}; stopping", flush=True)
            stop.set()

        # A child starts loading beside this process; a hosted decoder may be up already.
        decoder = DecodeProcess(args, metrics, on_exit=decoder_exited, attach=args.attach_decoder)
    codec, name = make_codec(args)
    slot_decoder = None
    if decoder is not None:
        try:
            ready = await decoder.start()
        except BaseException:
            decoder.close()
            raise
        metrics.slot_kernels.labels("attention", ready.attention).set(1)
        metrics.slot_kernels.labels("glue", ready.glue).set(1)
        where = f"the decoder hosted by process {decoder.pid}" if ready.hosted else f"decode process {decoder.pid}"
        print(f"vocoder: slots engine in {where}", flush=True)
    elif engine == "slots":
        slot_decoder = build_slot_decoder(codec, args)
        metrics.slot_kernels.labels("attention", slot_decoder.attention_path).set(1)
        metrics.slot_kernels.labels("glue", slot_decoder.glue_impl).set(1)
    max_batch, invariant = max(1, args.max_batch_streams), args.batch_mode == "invariant"
    if slot_decoder is not None or decoder is not None:
        max_batch = 1  # the stream engine only serves other codebook counts
    elif max_batch > 1 and invariant:
        problem = check_batch_invariance(codec, first_chunk(args), max(1, min(args.chunk_frames, MAX_CHUNK_FRAMES)))
        if problem is not None:
            print(f"vocoder: batched decode is not batch-invariant on {args.device}/{args.dtype} "
                  f"(torch threads {torch.get_num_threads()}): {problem}; decoding one stream per step",
                  flush=True)
            max_batch = 1
    if slot_decoder is None and decoder is None:
        print(f"vocoder: stream engine, up to {max_batch} streams per decode step"
              + ("" if max_batch == 1 else f" ({'batch-invariant' if invariant else 'fast, not batch-invariant'})"),
              flush=True)
    servicer = VocoderServicer(codec, name, first_chunk_frames=args.first_chunk_frames,
                               chunk_frames=args.chunk_frames, encode_cache_size=args.encode_cache_size,
                               max_batch_streams=max_batch, batch_invariant=invariant, metrics=metrics,
                               slot_decoder=slot_decoder, decoder=decoder, launch_ahead_streams=args.launch_ahead_streams,
                               step_frames=args.step_frames, stall_exit_s=stall_exit_seconds(args))
    if slot_decoder is None and decoder is None:
        # Warm-up: the first real step should not pay one-time allocation costs.
        codec.decode_step(codec.new_stream(), torch.zeros(1, 1, servicer.first_chunk_frames, dtype=torch.long),
                          batch_invariant=invariant)

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    vocoder_pb2_grpc.add_VocoderServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(_host_port(args.host, args.port))
    if port == 0:
        raise SystemExit(f"could not bind {_host_port(args.host, args.port)}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if args.metrics_port:
        http, _ = start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
            pass
    print(f"vocoder ready on {_host_port(args.host, port)}", flush=True)
    try:
        await stop.wait()
    finally:
        # Drain: report NOT_SERVING so balancers move away, let open calls finish, then stop.
        await health_servicer.enter_graceful_shutdown()
        await server.stop(args.grace)
        servicer.close()  # and the decode process, if there is one
        if http is not None:
            http.shutdown()
        print("vocoder stopped", flush=True)
    if failure is not None:
        raise SystemExit(f"vocoder: {failure}")


def run(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    asyncio.run(serve(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vocoder_svc.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

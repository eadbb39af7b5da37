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
engine. Startup prints a self-check of the byte-identity facts below. The
slot decoder and its step loop run in another process: a child decode
process (vocoder_svc/decode_process.py), or a decoder hosted elsewhere
(--attach-decoder), so that gRPC's threads, which hold the GIL while they
write PCM, never stall the steps; this process keeps the calls, the
chunking, Encode and the metrics.

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
    is that every step computes the full bucket whatever the load:
    throughput at full load is unchanged, latency at light load is not.
    Per-stream GEMMs (the stream engine's invariant mode) are not a cheap
    alternative here: cuBLAS gives no bitwise guarantee for a bmm across
    batch counts, and one GEMM per stream gives up the batching that makes
    the slot decoder fast.
Streams are limited to SlotDecoder.max_stream_frames frames (positions exact in
fp32: 2184 frames, ~175 s, for MOSS-Audio-Tokenizer v2); a longer stream
fails alone with OUT_OF_RANGE (which the scheduler does not fail over).

A replica serves one codec. With a Higgs-Audio-v2 codec (--preset higgs-tiny / higgs-full, or a
--codec directory holding one) it serves OmniVoice: whole clips through DecodeClip, Encode and Info,
and no streaming Decode (vocoder_svc/clip_servicer.py); everything above is the MOSS codec's.

    python -m vocoder_svc.server --port 50053 --preset tiny
    python -m vocoder_svc.server --port 50054 --preset higgs-tiny
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

from chorus.v1 import vocoder_pb2
from chorus.config import add_config_flags, parse_command_line
from chorus.drain import Drain
from chorus.request_decoding import add_service
from chorus.tls import TlsError, add_port
from vocoder_svc.clip_servicer import ClipServicer, HostedClipDecoder, make_clip_codec, serves_clips
from vocoder_svc.config import MAX_CHUNK_FRAMES, VocoderConfig
from vocoder_svc.decoder_build import first_chunk, make_codec, resolve_engine
from vocoder_svc.decoder_client import DecodeProcess
from vocoder_svc.metrics import Metrics
from vocoder_svc.selfcheck import check_batch_invariance
from vocoder_svc.servicer import VocoderServicer

SERVICE_NAME = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name  # "chorus.v1.Vocoder"
DRAINED = ("Decode", "DecodeClip", "Encode")  # refused while draining; Info is still answered
MAX_MESSAGE_BYTES = 64 << 20  # a 100 s 48 kHz stereo float32 reference is ~38 MB


# ---- startup -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, VocoderConfig)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _decode_process(args: VocoderConfig, metrics: Metrics, stop: asyncio.Event, failures: list[str]) -> DecodeProcess:
    """The decode process (a child, or with attach_decoder a decoder hosted elsewhere); when it ends
    the service stops, saying why in `failures`. A child starts loading beside this process; a hosted
    decoder may be up already."""
    def decoder_exited(reason: str) -> None:
        failures.append(reason)
        print(f"vocoder: {reason}; stopping", flush=True)
        stop.set()

    return DecodeProcess(args, metrics, on_exit=decoder_exited, attach=args.attach_decoder)


async def _clip_servicer(args: VocoderConfig, metrics: Metrics, stop: asyncio.Event,
                         failures: list[str]) -> ClipServicer:
    """OmniVoice's codec: whole clips, decoded here or (attach_decoder) by a codec the OmniVoice
    worker's process hosts, this process keeping the calls, the post-processing and Encode."""
    if not args.attach_decoder:
        return ClipServicer(make_clip_codec(args), metrics, encode_cache_size=args.encode_cache_size)
    process = _decode_process(args, metrics, stop, failures)
    try:
        codec = make_clip_codec(args, decodes=False)
        ready = await process.start()
    except BaseException:
        process.close()
        raise
    print(f"vocoder: DecodeClip forwards in the codec hosted by process {ready.pid}", flush=True)
    return ClipServicer(codec, metrics, encode_cache_size=args.encode_cache_size, decoder=HostedClipDecoder(process))


async def _moss_servicer(args: VocoderConfig, metrics: Metrics, stop: asyncio.Event,
                         failures: list[str]) -> VocoderServicer:
    """The MOSS codec's servicer over its decode engine (a decode process that ends sets `stop`
    and says why in `failures`)."""
    decoder = None
    if args.attach_decoder or resolve_engine(args.engine, args.device) == "slots":
        decoder = _decode_process(args, metrics, stop, failures)
    codec, name = make_codec(args)
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
    max_batch, invariant = max(1, args.max_batch_streams), args.batch_mode == "invariant"
    if decoder is not None:
        max_batch = 1  # the stream engine only serves other codebook counts
    else:
        if max_batch > 1 and invariant:
            problem = check_batch_invariance(codec, first_chunk(args),
                                             max(1, min(args.chunk_frames, MAX_CHUNK_FRAMES)))
            if problem is not None:
                print(f"vocoder: batched decode is not batch-invariant on {args.device}/{args.dtype} "
                      f"(torch threads {torch.get_num_threads()}): {problem}; decoding one stream per step",
                      flush=True)
                max_batch = 1
        print(f"vocoder: stream engine, up to {max_batch} streams per decode step"
              + ("" if max_batch == 1 else f" ({'batch-invariant' if invariant else 'fast, not batch-invariant'})"),
              flush=True)
    servicer = VocoderServicer(codec, name, first_chunk_frames=args.first_chunk_frames,
                               chunk_frames=args.chunk_frames, encode_cache_size=args.encode_cache_size,
                               max_batch_streams=max_batch, batch_invariant=invariant, metrics=metrics,
                               decoder=decoder)
    if decoder is None:
        # Warm-up: the first real step should not pay one-time allocation costs.
        codec.decode_step(codec.new_stream(), torch.zeros(1, 1, servicer.first_chunk_frames, dtype=torch.long),
                          batch_invariant=invariant)
    return servicer


async def serve(args: VocoderConfig, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    metrics = Metrics()
    failures: list[str] = []
    if serves_clips(args):  # OmniVoice's codec: whole clips
        servicer = await _clip_servicer(args, metrics, stop, failures)
    else:
        servicer = await _moss_servicer(args, metrics, stop, failures)

    # SIGTERM: the open streams decode what they are sent; new calls (Info aside) are refused with a
    # retry hint, and the scheduler's vocoder pool opens them on another replica
    drain = Drain(args.grace, "this vocoder replica")
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
                             interceptors=[drain.interceptor(tuple(f"/{SERVICE_NAME}/{m}" for m in DRAINED))])
    add_service(servicer, server, vocoder_pb2, "Vocoder")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    drain.health(health_servicer)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = add_port(server, args.host, args.port, args.tls_dir, args.require_client_cert, "the vocoder")
    except TlsError as e:
        raise SystemExit(f"vocoder.tls_dir: {e}") from None
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
        await drain.close(server, failures[0] if failures else "SIGTERM")
        servicer.close()  # and the decode process, if there is one
        if http is not None:
            http.shutdown()
        print("vocoder stopped", flush=True)
    if failures:
        raise SystemExit(f"vocoder: {failures[0]}")


def run(args: VocoderConfig) -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    if args.switch_interval_ms > 0:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    asyncio.run(serve(args))


def main(argv: list[str] | None = None, prog: str = "python -m vocoder_svc.server") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    config, _ = parse_command_line(VocoderConfig, parser, argv)
    run(config)


if __name__ == "__main__":
    sys.exit(main())

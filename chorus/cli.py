"""chorus — streaming text-to-speech serving.

  chorus demo                 start all three services on CPU (tiny model), speak, write demo.wav, stop
  chorus up                   start all three services locally until Ctrl-C
  chorus say "text" -o a.wav  synthesize through a running scheduler
  chorus worker|scheduler|vocoder   run one service (what a Kubernetes pod runs)
  chorus bench                load generator over the gRPC API (throughput, time to first audio)
  chorus bench worker         in-process worker microbenchmark (step time against batch and context)

Every command takes --help.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_TEXT = ("Chorus streams speech as it is generated: the scheduler batches requests, "
                "the worker runs the model, and the vocoder turns codes into sound.")


def _service_parsers(sub) -> None:
    from gpu_worker import server as worker
    from scheduler_svc import server as scheduler
    from vocoder_svc import server as vocoder

    for name, module, help_ in (
            ("worker", worker, "run a gpu_worker: the model behind a ZeroMQ socket"),
            ("scheduler", scheduler, "run the scheduler: the public gRPC API, batching, request lifecycle"),
            ("vocoder", vocoder, "run a vocoder replica: codes to waveform, reference audio to codes")):
        p = sub.add_parser(name, help=help_, description=(module.__doc__ or help_).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    from chorus.launcher import add_service_flags
    add_service_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address the services listen on")
    p.add_argument("--port", type=int, default=50051, help="scheduler (public API) port; 0 = any free port")
    p.add_argument("--metrics-port", type=int, default=0, help="scheduler Prometheus port (0 = off)")
    p.add_argument("--quiet", action="store_true", help="do not relay the services' logs")


def _cluster(args: argparse.Namespace):
    from chorus.launcher import Cluster, colocation, service_args

    worker, vocoder, scheduler = service_args(args.model, args.codec, args.device, args.dtype, args.vocoder_device)
    scheduler += ["--metrics-port", str(args.metrics_port), "--frontends", str(getattr(args, "frontends", 1))]
    replicas = max(1, getattr(args, "vocoders", 1))
    colocate, vocoder = colocation(args.colocate_vocoder, args.device, args.vocoder_device, replicas,
                                   vocoder + args.vocoder_arg)
    return Cluster(worker_args=worker + args.worker_arg, vocoder_args=vocoder,
                   scheduler_args=scheduler + args.scheduler_arg, host=args.host, scheduler_port=args.port,
                   vocoder_ports=[0] * replicas, echo=not args.quiet, colocate_vocoder=colocate,
                   shared_decoder=args.shared_vocoder_decoder)


def cmd_up(args: argparse.Namespace) -> None:
    cluster = _cluster(args)
    print("starting worker, vocoder and scheduler ...", flush=True)
    with cluster:
        vocoders = ", ".join(s.address for s in cluster.services if s.name.startswith("vocoder"))
        print(f"\nChorus is up. API: {cluster.address}  (worker {cluster.service('worker').address}, "
              f"vocoder {vocoders})\n"
              f"Try: chorus say \"Hello there.\" --server {cluster.address} -o hello.wav\n"
              "Ctrl-C stops all three.", flush=True)
        try:
            while all(s.proc.poll() is None for s in cluster.services):
                time.sleep(0.5)
            dead = [s.name for s in cluster.services if s.proc.poll() is not None]
            print(f"{', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)


def _say_request(args: argparse.Namespace):
    from chorus.v1 import common_pb2, tts_pb2

    req = tts_pb2.SynthesizeRequest(text=args.text, language=args.language or "", format=tts_pb2.PCM16,
                                    max_frames=args.max_frames, min_frames=args.min_frames,
                                    duration_frames=args.duration_frames, sample_rate=args.sample_rate)
    if args.seed is not None:
        req.sampling.seed = args.seed
    if args.temperature is not None:
        req.sampling.temperature = args.temperature
    if args.voice:
        with open(args.voice, "rb") as f:
            req.references.add(audio=common_pb2.AudioData(data=f.read()))
    return req


def cmd_say(args: argparse.Namespace) -> None:
    import grpc
    import soundfile as sf

    from chorus.client import channel, synthesize
    from chorus.v1 import tts_pb2_grpc

    stub = tts_pb2_grpc.TextToSpeechStub(channel(args.server))

    def progress(s):
        secs = sum(c.num_samples for c in s.chunks) / s.header.sample_rate
        print(f"\r  {secs:6.2f} s of audio received", end="", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    try:
        result = synthesize(stub, _say_request(args), timeout=args.timeout, on_chunk=progress)
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(2)
    wall = time.monotonic() - t0
    pcm = result.pcm()
    sf.write(args.output, pcm, result.header.sample_rate, subtype="PCM_16")
    s = result.summary
    print(f"\nwrote {args.output}: {pcm.shape[0] / result.header.sample_rate:.2f} s, "
          f"{result.header.sample_rate} Hz, {result.header.channels} ch; {s.frames} frames "
          f"({tts_pb2_name(s.finish_reason)}), first audio {s.first_audio_ms:.0f} ms, total {wall:.2f} s")


def tts_pb2_name(reason: int) -> str:
    from chorus.v1 import tts_pb2
    return tts_pb2.FinishReason.Name(reason).lower()


def _add_say_flags(p: argparse.ArgumentParser, default_output: str) -> None:
    p.add_argument("-o", "--output", default=default_output, help="WAV file to write")
    p.add_argument("--language", help="language name written into the prompt, e.g. English")
    p.add_argument("--voice", metavar="AUDIO", help="reference audio file to clone (WAV/FLAC/OGG)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same audio")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy)")
    p.add_argument("--max-frames", type=int, default=0, help="stop after this many 80 ms frames (0 = server default)")
    p.add_argument("--min-frames", type=int, default=0, help="never stop before this many frames")
    p.add_argument("--duration-frames", type=int, default=0, help="duration hint for the model, in frames")
    p.add_argument("--sample-rate", type=int, default=0, help="output sample rate (0 = native 48 kHz)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")


def cmd_demo(args: argparse.Namespace) -> None:
    from chorus.prompt import estimate_duration_frames

    # The tiny preset has random weights, so its stop choice is a coin flip:
    # pin the length to the text's estimated duration instead.
    frames = estimate_duration_frames(args.text, "English")
    args.min_frames = args.min_frames or frames
    args.max_frames = args.max_frames or frames
    args.port = 0
    cluster = _cluster(args)
    print("starting worker, vocoder and scheduler (tiny model, CPU) ...", flush=True)
    with cluster:
        args.server = cluster.address
        print(f"services up; synthesizing {frames} frames ({frames * 0.08:.1f} s) ...", flush=True)
        cmd_say(args)
    print("services stopped.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "worker"]:  # the worker microbenchmark has flags of its own
        from chorus.bench import worker as worker_bench
        return worker_bench.main(argv[2:])
    parser = argparse.ArgumentParser(prog="chorus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="start everything on CPU, synthesize a sentence to demo.wav, stop")
    p.add_argument("text", nargs="?", default=DEFAULT_TEXT, help="what to say")
    _add_model_flags(p)
    _add_say_flags(p, "demo.wav")
    p.set_defaults(func=cmd_demo, quiet=True, seed=1234)

    p = sub.add_parser("up", help="start worker, vocoder and scheduler locally; Ctrl-C stops them")
    _add_model_flags(p)
    p.add_argument("--vocoders", type=int, default=1, metavar="N",
                   help="vocoder replicas (on --vocoder-device, or the worker's device). Replicas on one GPU take "
                        "turns on it (each is a CUDA context of its own), but one vocoder process cannot feed an "
                        "H200 at high load: two replicas of 128 --slots won at W1 c256 (see README, \"Two GPUs at "
                        "high load\", and --shared-vocoder-decoder)")
    p.add_argument("--frontends", type=int, default=1, metavar="N", help="the scheduler's --frontends")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("say", help="synthesize text through a running scheduler into a WAV file")
    p.add_argument("text", help="what to say")
    p.add_argument("--server", default="127.0.0.1:50051", help="scheduler address HOST:PORT")
    _add_say_flags(p, "out.wav")
    p.set_defaults(func=cmd_say)

    from chorus.bench import add_bench_parser
    add_bench_parser(sub)

    _service_parsers(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

"""chorus — streaming text-to-speech serving.

  chorus demo                 start all three services on CPU (tiny model), speak, write demo.wav, stop
                              (--model omnivoice: the same with OmniVoice's tiny preset)
  chorus up                   start all three services locally until Ctrl-C (--profile NAME, --config FILE)
  chorus say "text" -o a.wav  synthesize through a running scheduler (--model omnivoice for OmniVoice)
  chorus worker|scheduler|vocoder|frontend|gateway   run one service (what a Kubernetes pod runs)
  chorus bench                load generator over the gRPC API (throughput, time to first audio)
  chorus bench worker         in-process worker microbenchmark (step time against batch and context)

Every command takes --help.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

DEFAULT_TEXT = ("Chorus streams speech as it is generated: the scheduler batches requests, "
                "the worker runs the model, and the vocoder turns codes into sound.")


SERVICES = {"worker": ("chorus.colocate", "run a gpu_worker: the model behind a ZeroMQ socket (and a hosted "
                                             "vocoder decoder with --host-vocoder-decoder)"),
            "scheduler": ("scheduler_svc.server",
                          "run the scheduler: the public gRPC API, batching, request lifecycle"),
            "vocoder": ("vocoder_svc.server", "run a vocoder replica: codes to waveform, reference audio to codes"),
            "frontend": ("scheduler_svc.frontend_tier", "run a frontend tier process: the public gRPC API in front "
                                                       "of many engines (--engines), one picked per request"),
            "gateway": ("gateway_svc.server", "run the HTTP gateway: the OpenAI-style speech API and the playground, "
                                              "in front of a scheduler")}


def _service_parsers(sub) -> None:
    """The services' commands, listed in the help; `main` hands their arguments to the service's own main."""
    for name, (_, help_) in SERVICES.items():
        sub.add_parser(name, help=help_, add_help=False)


def _add_layout_flags(p: argparse.ArgumentParser, without: tuple[str, ...] = ()) -> None:
    """The layout's everyday flags, less the [cluster] keys in `without`."""
    import inspect

    from chorus.layout import add_layout_flags
    everyday = inspect.signature(add_layout_flags).parameters["cluster_keys"].default
    add_layout_flags(p, cluster_keys=tuple(k for k in everyday if k not in without),
                     scheduler_keys=("port", "metrics_port", "frontends"))
    p.add_argument("--print-config", action="store_true", help="print the layout's effective TOML and exit")


def _layout(args: argparse.Namespace):
    from chorus.config import ConfigError
    from chorus.layout import load

    try:
        return load(args)
    except ConfigError as e:
        raise SystemExit(f"chorus {args.command}: {e}") from None


def cmd_up(args: argparse.Namespace) -> None:
    layout = _layout(args)
    if args.print_config:
        print(layout.toml(), end="")
        return
    cluster = layout.cluster_launcher(die_with_parent=True, temporary_voices=False)  # voices outlive the run

    def terminate(*_):  # SIGTERM (a supervisor, kill) stops the services as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    print("starting worker, vocoder and scheduler ...", flush=True)
    with cluster:
        named = lambda prefix: ", ".join(s.address for s in cluster.services if s.name.startswith(prefix))  # noqa: E731
        engines = f"engine links {named('engine')}, " if cluster.engines else ""
        http = f"  HTTP: http://{cluster.http_address}/" if cluster.http_address else ""
        print(f"\nChorus is up. API: {cluster.address}{http}  (worker {named('worker')}, {engines}"
              f"vocoder {named('vocoder')})\n"
              f"Try: chorus say \"Hello there.\" --server {cluster.address} -o hello.wav\n"
              "Ctrl-C stops all three.", flush=True)
        try:
            dead = cluster.supervise(threading.Event())  # restarts the scheduler; returns when another dies
            print(f"{dead} exited; stopping the rest", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            # leaving the block drains the services one tier after another; a second signal must not cut it
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("\nstopping (draining the open streams) ...", flush=True)


# `chorus say` flags -> OmniVoiceParams fields (set only when given)
OMNIVOICE_FLAGS = ("num_step", "guidance_scale", "t_shift", "layer_penalty_factor", "position_temperature",
                   "class_temperature", "speed", "denoise", "postprocess")


def _say_request(args: argparse.Namespace):
    from chorus.v1 import common_pb2, tts_pb2

    req = tts_pb2.SynthesizeRequest(text=args.text, model=args.model or "", language=args.language or "",
                                    instructions=args.instructions or "", format=tts_pb2.PCM16,
                                    max_frames=args.max_frames, min_frames=args.min_frames,
                                    duration_frames=args.duration_frames, duration_seconds=args.duration_seconds,
                                    sample_rate=args.sample_rate)
    if args.seed is not None:
        req.sampling.seed = args.seed
    if args.temperature is not None:
        req.sampling.temperature = args.temperature
    for name in OMNIVOICE_FLAGS:
        if getattr(args, name) is not None:
            setattr(req.omnivoice, name, getattr(args, name))
    if args.voice:
        with open(args.voice, "rb") as f:
            req.references.add(audio=common_pb2.AudioData(data=f.read()), transcript=args.transcript or "")
    return req


def cmd_say(args: argparse.Namespace) -> None:
    import grpc
    import soundfile as sf

    from chorus.client import Client, Synthesis, add_response, credentials

    ca = getattr(args, "tls_ca", None)  # `chorus demo` runs its own loopback cluster: plaintext, no key
    creds = credentials(ca, args.tls_cert, args.tls_key) if ca else None
    t0 = time.monotonic()
    result = Synthesis()
    try:
        with Client(args.server, timeout=args.timeout, api_key=getattr(args, "api_key", None), creds=creds) as client:
            for resp in _say_responses(client, args):
                add_response(result, resp, t0)
                if resp.WhichOneof("kind") == "audio":
                    secs = sum(c.num_samples for c in result.chunks) / result.header.sample_rate
                    print(f"\r  {secs:6.2f} s of audio received", end="", file=sys.stderr, flush=True)
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(2)
    wall = time.monotonic() - t0
    pcm = result.pcm()
    sf.write(args.output, pcm, result.header.sample_rate, subtype="PCM_16")
    s = result.summary
    spoken = (f"{len(result.sentences)} sentences" if result.sentences else
              f"{s.frames} frames ({tts_pb2_name(s.finish_reason)}), first audio {s.first_audio_ms:.0f} ms")
    print(f"\nwrote {args.output}: {pcm.shape[0] / result.header.sample_rate:.2f} s, "
          f"{result.header.sample_rate} Hz, {result.header.channels} ch; {spoken}, total {wall:.2f} s")


def _say_responses(client, args: argparse.Namespace):
    """Synthesize the text, or with text `-` SynthesizeStream stdin's text as it arrives."""
    request = _say_request(args)
    if args.text != "-":
        return client.stream(request)
    request.text = ""
    return client.synthesize_stream(request, _stdin_pieces())


def _stdin_pieces():
    """stdin's text as it arrives (not line by line: an LLM writes words)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    while data := os.read(sys.stdin.fileno(), 4096):
        yield decoder.decode(data)
    yield decoder.decode(b"", final=True)


def tts_pb2_name(reason: int) -> str:
    from chorus.v1 import tts_pb2
    return tts_pb2.FinishReason.Name(reason).lower()


def _add_say_flags(p: argparse.ArgumentParser, default_output: str) -> None:
    p.add_argument("-o", "--output", default=default_output, help="WAV file to write")
    p.add_argument("--language", help="language of the text, e.g. English or en")
    p.add_argument("--instructions", help="style instruction (OmniVoice: voice design, e.g. \"female, low pitch\")")
    p.add_argument("--voice", metavar="AUDIO", help="reference audio file to clone (WAV/FLAC/OGG)")
    p.add_argument("--transcript", help="what the --voice audio says (OmniVoice clones need it)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: same seed, same audio")
    p.add_argument("--temperature", type=float, default=None, help="MOSS sampling temperature (0 = greedy)")
    p.add_argument("--max-frames", type=int, default=0, help="MOSS: stop after this many 80 ms frames (0 = server "
                   "default)")
    p.add_argument("--min-frames", type=int, default=0, help="MOSS: never stop before this many frames")
    p.add_argument("--duration-frames", type=int, default=0, help="MOSS: duration hint for the model, in frames")
    p.add_argument("--duration-seconds", type=float, default=0.0, help="length of the speech in seconds (0 = from "
                   "the text)")
    p.add_argument("--sample-rate", type=int, default=0, help="output sample rate in Hz (0 = the model's native rate)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    g = p.add_argument_group("OmniVoice knobs (unset: the model's defaults)")
    g.add_argument("--num-step", type=int, default=None, help="unmasking steps, 1..64 (default 32)")
    g.add_argument("--guidance-scale", type=float, default=None, help="classifier-free guidance, 0..10; 0 = off "
                   "(default 2)")
    g.add_argument("--t-shift", type=float, default=None, help="schedule shift, (0, 1] (default 0.1)")
    g.add_argument("--layer-penalty-factor", type=float, default=None, help="reveal penalty per codebook, >= 0 "
                   "(default 5)")
    g.add_argument("--position-temperature", type=float, default=None, help="reveal order temperature; 0 = "
                   "deterministic (default 5)")
    g.add_argument("--class-temperature", type=float, default=None, help="token temperature; 0 = greedy (default 0)")
    g.add_argument("--speed", type=float, default=None, help="speaking rate factor, 0.25..4 (default 1)")
    g.add_argument("--no-denoise", dest="denoise", action="store_const", const=False, default=None,
                   help="leave the denoise token out of clone prompts")
    g.add_argument("--no-postprocess", dest="postprocess", action="store_const", const=False, default=None,
                   help="keep silences and the raw edges (no trim, fade or pad)")


DEMO_MODELS = ("moss", "omnivoice")


def cmd_demo(args: argparse.Namespace) -> None:
    from chorus.prompt import estimate_duration_frames

    if args.model not in DEMO_MODELS:  # a MOSS checkpoint directory
        setattr(args, "cluster.model", args.model)
        args.model = "moss"
    if args.model == "omnivoice":
        setattr(args, "cluster.omnivoice", True)
        # OmniVoice's length comes from the text; its tiny preset runs few steps to be quick
        args.num_step = args.num_step or 8
        what = "OmniVoice"
    else:
        # The tiny preset has random weights, so its stop choice is a coin flip:
        # pin the length to the text's estimated duration instead.
        frames = estimate_duration_frames(args.text, "English")
        args.min_frames = args.min_frames or frames
        args.max_frames = args.max_frames or frames
        what = f"{frames} frames ({frames * 0.08:.1f} s)"
    layout = _layout(args)
    layout.scheduler.port = 0
    if args.print_config:
        print(layout.toml(), end="")
        return
    cluster = layout.cluster_launcher()
    print("starting worker, vocoder and scheduler (tiny model, CPU) ...", flush=True)
    with cluster:
        args.server = cluster.address
        print(f"services up; synthesizing {what} ...", flush=True)
        cmd_say(args)
    print("services stopped.")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SERVICES:  # a service parses its own flags
        import importlib
        return importlib.import_module(SERVICES[argv[0]][0]).main(argv[1:], prog=f"chorus {argv[0]}")
    if argv[:2] == ["bench", "worker"]:  # the worker microbenchmark has flags of its own
        from chorus.bench import worker as worker_bench
        return worker_bench.main(argv[2:])
    parser = argparse.ArgumentParser(prog="chorus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="start everything on CPU, synthesize a sentence to demo.wav, stop")
    p.add_argument("text", nargs="?", default=DEFAULT_TEXT, help="what to say")
    _add_layout_flags(p, without=("model", "http_port"))  # demo's --model picks the model to demo
    p.add_argument("--model", default="moss", help="model to demo: moss, omnivoice, or a MOSS-TTS checkpoint "
                   "directory")
    _add_say_flags(p, "demo.wav")
    p.set_defaults(func=cmd_demo, seed=1234, **{"cluster.quiet": True})

    p = sub.add_parser("up", help="start worker, vocoder and scheduler locally; Ctrl-C stops them",
                       description="Start worker, vocoder(s) and scheduler on this machine from a layout: a "
                                   "profile (--profile), a TOML file (--config), and the flags below on top.")
    _add_layout_flags(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("say", help="synthesize text through a running scheduler into a WAV file")
    p.add_argument("text", help="what to say; - reads it from stdin as it arrives and speaks it sentence by "
                   "sentence (SynthesizeStream)")
    p.add_argument("--server", default="127.0.0.1:50051", help="scheduler address HOST:PORT")
    p.add_argument("--model", default="", help="model to speak with: a served model's name or architecture, e.g. "
                   "omnivoice (empty: the server's default)")
    p.add_argument("--api-key", default=os.environ.get("CHORUS_API_KEY"), help="API key sent as `authorization: "
                   "Bearer KEY` (default: $CHORUS_API_KEY)")
    p.add_argument("--tls-ca", metavar="FILE", help="CA certificate (PEM) to verify the server with: use TLS")
    p.add_argument("--tls-cert", metavar="FILE", help="with --tls-ca: client certificate (PEM) for mTLS")
    p.add_argument("--tls-key", metavar="FILE", help="with --tls-cert: its private key (PEM)")
    _add_say_flags(p, "out.wav")
    p.set_defaults(func=cmd_say)

    from chorus.bench import add_bench_parser
    add_bench_parser(sub)

    _service_parsers(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

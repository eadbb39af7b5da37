"""A scheduler_svc frontend process: serves the public API (scheduler_svc/frontend.py) on the shared
port, from its parent core or, as a frontend tier process, from the engines it is given; health as
the workers and vocoder replicas answer; the drain; an exit that makes its supervisor restart it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from chorus.api_keys import ApiKeyInterceptor, ApiKeys, KeyFileError
from chorus.caller_limits import CallerLimits, Limit
from chorus.drain import Drain
from chorus.moss_config import MossTTSLocalConfig
from chorus.omnivoice import knobs as ov
from chorus.request_decoding import add_service
from chorus.tls import TlsError, add_port
from chorus.tokenizer import load_tokenizer
from chorus.v1 import tts_pb2
from chorus.voice_store import VoiceStoreError, open_store
from scheduler_svc.clip_vocoders import ClipVocoders
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core_client import CoreUnavailable
from scheduler_svc.engine_pool import EnginePool
from scheduler_svc.flow_control import Backlog
from scheduler_svc.frontend import SERVICE_NAME, WRITES, TextToSpeechServicer
from scheduler_svc.omnivoice_frontend import OmniVoiceFrontend
from scheduler_svc.served_models import MOSS, OMNIVOICE, ServedModel, ServedModels
from scheduler_svc.synthesize_stream import PieceLimits
from scheduler_svc.validation import Limits
from scheduler_svc.vocoder_client import VocoderPool
from scheduler_svc.voices import VoiceLibrary

log = logging.getLogger("chorus.scheduler")
CORE_LAG_S = 2.0  # a draining core ends its last requests at its deadline: their status goes out first
VOCODER_CHECK_S = 1.0  # how often health probes the vocoder replicas


async def _watch_core(stop: asyncio.Event, core: EnginePool) -> None:
    """The core started this process: when it is gone (even by SIGKILL), or the link to it fails, so is
    this one, with a non-zero exit (serve raises SystemExit) so that its supervisor restarts the service."""
    parent = os.getppid()
    while os.getppid() == parent and not core.broken:
        await asyncio.sleep(1.0)
    log.error("the scheduler core (pid %d) is gone or its link failed (%s); stopping", parent,
              core.broken or "its process exited")
    stop.set()


async def _serve_health(health_servicer, core: EnginePool, models: ServedModels,
                        pools: dict[str, VocoderPool], drain) -> None:
    """grpc health as the core sees the workers and this frontend its vocoders (pools: each model's,
    probed every VOCODER_CHECK_S): a model none of whose workers answers, or whose pool has no live
    replica, is NOT_SERVING under `chorus.v1.TextToSpeech/<model>`, and the service as a whole when it
    is the default model. A draining parent core drains this frontend too: drain() stops taking calls
    (health NOT_SERVING for good)."""
    statuses: dict[str, int] = {}
    without_vocoder: set[str] = set()  # every pool answered Info at start-up
    while True:
        if core.draining:
            drain()
        core.health_changed.clear()
        for m in models.models:
            status = health_pb2.HealthCheckResponse.NOT_SERVING if m.name in core.down or \
                m.name in without_vocoder else health_pb2.HealthCheckResponse.SERVING
            for name in (f"{SERVICE_NAME}/{m.name}", *(("", SERVICE_NAME) if m == models.default else ())):
                if statuses.get(name) != status:
                    await health_servicer.set(name, status)
                    statuses[name] = status
        try:
            await asyncio.wait_for(core.health_changed.wait(), VOCODER_CHECK_S)
        except asyncio.TimeoutError:
            pass
        live = {id(pool): await pool.check() for pool in {id(p): p for p in pools.values()}.values()}
        without_vocoder = {name for name, pool in pools.items() if not live[id(pool)]}


async def _omnivoice(args: SchedulerConfig, core: EnginePool, cfg: MossTTSLocalConfig, limits: Limits,
                     index: int, voices: VoiceLibrary) -> tuple[ServedModels, OmniVoiceFrontend | None]:
    """The served models, and the OmniVoice path when the core schedules OmniVoice workers."""
    served = [ServedModel(cfg.name, MOSS)] + [ServedModel(h.model_name, OMNIVOICE) for h in core.hello.canvas_workers]
    try:
        models = ServedModels(served, core.hello.default_model or args.default_model)
    except ValueError as e:
        raise SystemExit(f"frontend {index}: {e}") from None
    if not core.hello.canvas_workers:
        return models, None
    from chorus.omnivoice.tokenizer import load_omnivoice_tokenizer

    if not args.omnivoice_vocoder:  # a frontend tier's engines schedule OmniVoice; the tier decodes it
        raise SystemExit(f"frontend {index}: the engines serve {core.hello.canvas_workers[0].model_name} but "
                         f"scheduler.omnivoice_vocoder is empty: give an OmniVoice codec vocoder's address")
    clips = ClipVocoders(args.omnivoice_vocoder, tls_dir=args.vocoder_tls_dir)
    if index == 0:
        log.info("waiting for the OmniVoice vocoder at %s", clips.replicas[0].address)
    info = await clips.info(timeout=600)
    if (info.sample_rate, info.channels, info.samples_per_frame) != (ov.SAMPLE_RATE, 1, ov.SAMPLES_PER_FRAME):
        raise SystemExit(f"frontend {index}: the OmniVoice vocoder serves {info.codec} at {info.sample_rate} Hz, "
                         f"{info.channels} ch, {info.samples_per_frame} samples per frame; OmniVoice needs its "
                         f"codec (24000 Hz, 1 ch, 960)")
    return models, OmniVoiceFrontend(core, clips, load_omnivoice_tokenizer(args.omnivoice_tokenizer), limits,
                                     voices)


async def serve(args: SchedulerConfig, core_endpoint: str | None, index: int) -> None:
    """Serve the API from the core at core_endpoint (this process's parent), or with None as a frontend
    tier process, from the engines args.engines names."""
    if core_endpoint:
        core = EnginePool([core_endpoint], args.link_message_bytes(), parent=True)
    else:
        core = EnginePool(args.engines, args.link_message_bytes(), (args.curve_secret_key, args.engine_public_key)
                          if args.engine_public_key else None, args.engine_refresh, args.engine_load_slack,
                          args.engine_load_margin)
    try:
        hello = await core.connect(timeout=600)
    except CoreUnavailable as e:
        raise SystemExit(f"frontend {index}: {e}") from None
    cfg = MossTTSLocalConfig.from_dict(json.loads(hello.worker.model_config_json))
    vocoders = VocoderPool(args.vocoder, tls_dir=args.vocoder_tls_dir)
    if index == 0:
        log.info("waiting for the vocoder at %s", vocoders.replicas[0].address)
    codec = await vocoders.info(timeout=600)
    if not vocoders.chunks[1]:
        raise SystemExit(f"frontend {index}: the vocoder does not announce its chunk sizes (VocoderInfo.chunk_frames); "
                         f"run a vocoder_svc of this release")
    if index == 0:
        log.info("vocoder chunk defaults: first chunk %d, chunk %d frames", *vocoders.chunks)
    tokenizer = load_tokenizer(args.tokenizer)
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    try:
        store = await asyncio.to_thread(open_store, args.voice_store)
    except (ValueError, VoiceStoreError) as e:
        raise SystemExit(f"frontend {index}: scheduler.voice_store: {e}") from None
    if index == 0:
        log.info("voices in %s", store.url)
    voices = VoiceLibrary(store, args.max_voices)
    models, omnivoice = await _omnivoice(args, core, cfg, limits, index, voices)

    try:
        keys = ApiKeys(args.api_keys) if args.api_keys else None
    except KeyFileError as e:
        raise SystemExit(f"frontend {index}: scheduler.{e}") from None
    # SO_REUSEPORT (gRPC's default on Linux) lets every frontend listen on the same port
    drain = Drain(args.drain_seconds, f"scheduler frontend {index}")
    interceptors = [ApiKeyInterceptor(keys, (SERVICE_NAME,))] if keys else []
    interceptors.append(drain.interceptor(tuple(f"/{SERVICE_NAME}/{m}" for m in WRITES)))
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", args.max_request_bytes),
                                      ("grpc.so_reuseport", 1)], interceptors=interceptors)
    backlog = Backlog(args.max_stream_buffer_bytes, args.max_frontend_buffer_bytes, args.reader_stall)
    add_service(
        TextToSpeechServicer(core, vocoders, cfg, tokenizer, limits, codec, voices, args.first_chunk_frames_loaded,
                             models, omnivoice, backlog, keys,
                             PieceLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PieceLimits)}),
                             CallerLimits(Limit(args.max_calls_per_owner, args.calls_per_minute_per_owner,
                                                args.call_burst_per_owner))),
        server, tts_pb2, "TextToSpeech")
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    drain.health(health_servicer)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server)
    try:
        bound = add_port(server, args.host, args.port, args.tls_dir, args.require_client_cert,
                         f"frontend {index}" if index else "the public API")
    except TlsError as e:
        raise SystemExit(f"frontend {index}: scheduler.tls_dir: {e}") from None
    if bound != args.port:
        raise SystemExit(f"frontend {index}: could not listen on {args.host}:{args.port}")
    await server.start()
    loop = asyncio.get_running_loop()
    pools = {m.name: omnivoice.vocoders if m.architecture == OMNIVOICE else vocoders for m in models.models}
    follow_core = lambda: drain.close(server, "the core drains", args.drain_seconds + CORE_LAG_S)  # noqa: E731
    health_task = loop.create_task(_serve_health(health_servicer, core, models, pools, follow_core))
    core.report("ready")

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, keys.reload if keys else lambda: None)  # the core relays its SIGHUP
    if core_endpoint:
        watcher = loop.create_task(_watch_core(stop, core))
    else:
        watcher = loop.create_task(asyncio.sleep(float("inf")))
        print(f"frontend ready on {args.host}:{bound} engines={','.join(core.specs)} "
              f"vocoders={','.join(args.vocoder)}", flush=True)
    await stop.wait()
    core_gone = watcher.done()
    watcher.cancel()
    health_task.cancel()
    if core_gone:  # nothing can be served: no drain
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=0)
    else:
        await drain.close(server)
    await vocoders.close()
    if omnivoice is not None:
        await omnivoice.vocoders.close()
    core.close()
    voices.close()
    if core_gone:
        raise SystemExit(1)


def run(args: SchedulerConfig, core: str, index: int) -> None:
    """Serve the API as frontend `index` of the core at endpoint `core`."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s scheduler/frontend{index} %(levelname)s %(message)s")
    asyncio.run(serve(args, core, index))

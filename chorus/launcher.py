"""Starts the three services as real local processes and stops them.

Used by `chorus up` / `chorus demo` and by the end-to-end tests. Each service
prints one `... ready on ADDRESS` line when it serves; the launcher waits for
it (so ephemeral ports work) and relays every line with a prefix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Collection

from chorus.config import parse, write_proto
from chorus.processes import LaunchError, Service
from gpu_worker.config import WorkerConfig
from scheduler_svc.config import SchedulerConfig
from vocoder_svc.config import VocoderConfig

DRAIN_MARGIN_S = 5.0  # a service's exit after its drain


def same_device(a: str, b: str) -> bool:
    norm = lambda d: d + ":0" if d == "cuda" else d  # noqa: E731 - the current device, as the services pick it
    return norm(a) == norm(b)


def colocation(choice: str, device: str, vocoder_device: str | None, replicas: int, vocoder: VocoderConfig,
               given: Collection[str] = ()) -> tuple[bool, VocoderConfig]:
    """(colocate?, the vocoder's config) for colocate_vocoder auto|on|off; `given`: the vocoder
    settings a file or flag set, which this leaves alone.

    On the worker's device (colocated or not) the vocoder launches a step ahead only when it carries
    half its slots: its own default, every step, is for a GPU of its own, and beside the worker a
    queued step delays the worker's kernels and new streams' first chunks. Colocated, the decoder
    runs in first-chunk-sized steps: new streams' first chunks then share steps with the steady ones
    instead of waiting."""
    vdev = vocoder_device or device
    shared = same_device(device, vdev)
    on = choice == "on" or (choice == "auto" and device.startswith("cuda") and replicas == 1 and shared)
    vocoder = dataclasses.replace(vocoder)
    if (shared or on) and "launch_ahead_streams" not in given:
        vocoder.launch_ahead_streams = max(1, vocoder.slots // 2) if vocoder.slots else 0  # 0: half the sized slots
    if on and "step_frames" not in given:
        vocoder.step_frames = vocoder.first_chunk_frames
    return on, vocoder


@dataclass
class Cluster:
    """worker + vocoder(s) + scheduler on this machine, and with `omnivoice_worker` set an OmniVoice
    worker and its codec vocoder(s) too. Each service starts from its config (`worker`, `vocoder`,
    `scheduler`, `omnivoice_*`), with the flags in `*_args` on top; the launcher sets the addresses
    and ports, and hands each process its config as protobuf (--config-proto FILE)."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)
    vocoder: VocoderConfig = field(default_factory=VocoderConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker_args: list[str] = field(default_factory=list)
    vocoder_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    scheduler_port: int = 0
    worker_port: int = 0
    vocoder_ports: list[int] = field(default_factory=lambda: [0])
    # Prometheus ports of the vocoders, one per replica (0 = none); None: no metrics endpoints
    vocoder_metrics_ports: list[int] | None = None
    echo: bool = False
    # The vocoder's decoder in the worker's process (one replica, the worker's device): see
    # gpu_worker --host-vocoder-decoder.
    colocate_vocoder: bool = False
    # The vocoder replicas in front of one decoder process: see vocoder_svc.decode_process.main.
    shared_decoder: bool = False
    # The services get SIGTERM when the thread that started them ends (chorus up: its main thread).
    die_with_parent: bool = False
    # OmniVoice beside MOSS: its worker and codec vocoder replicas (one per port); None: not served.
    omnivoice_worker: WorkerConfig | None = None
    omnivoice_vocoder: VocoderConfig | None = None
    omnivoice_vocoder_ports: list[int] = field(default_factory=lambda: [0])
    # OmniVoice's codec forwards in the OmniVoice worker's process (one replica, attached to it): see
    # vocoder_svc/clip_host.py.
    colocate_omnivoice_codec: bool = False
    # Prometheus ports of the OmniVoice codec's replicas, one per port above; None: no metrics endpoints
    omnivoice_vocoder_metrics_ports: list[int] | None = None
    # CURVE on the worker links with a key pair made for this run (a worker or scheduler config that
    # names its own keys keeps them).
    curve: bool = False
    # Voices in a file of this run's temporary directory unless the scheduler config names a
    # voice_store (False: the per-user default file, so voices outlive the run: chorus up).
    temporary_voices: bool = True
    # The tiers as a cluster runs them: `engines` engines (a worker and a scheduler core with frontends = 0
    # each, the core's frontend link on TCP) behind `frontend_tier` frontend tier processes sharing the
    # public port (SO_REUSEPORT); 0: one scheduler with its own frontends.
    engines: int = 0
    frontend_tier: int = 1
    engine_metrics_ports: list[int] | None = None  # Prometheus port of each engine's core (None: none)
    frontend_metrics_ports: list[int] | None = None  # Prometheus port of each frontend tier process (None: none)
    # The HTTP gateway (gateway_svc) in front of the public API, on this port (0: a free one); None: none.
    gateway_port: int | None = None
    services: list[Service] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory | None = None
    _worker_curve: tuple[str, str] | None = None  # (secret key file, clients dir) made for this run
    _reservation: socket.socket | None = None      # holds the frontend tier's shared port
    _scheduler: SchedulerConfig | None = None  # the scheduler's config as written for it
    restarts: int = 0  # scheduler restarts by supervise()

    @property
    def address(self) -> str:
        """The public gRPC API's."""
        return next(s.address for s in reversed(self.services) if s.name != "gateway")

    @property
    def http_address(self) -> str | None:
        """The HTTP gateway's HOST:PORT (None: no gateway)."""
        return next((s.address for s in self.services if s.name == "gateway"), None)

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def configs(self) -> tuple[WorkerConfig, VocoderConfig, SchedulerConfig]:
        """The three configs as the services get them, before addresses and ports."""
        return (parse(WorkerConfig, self.worker_args, base=self.worker),
                parse(VocoderConfig, self.vocoder_args, base=self.vocoder),
                parse(SchedulerConfig, self.scheduler_args, base=self.scheduler))

    def start(self, timeout: float = 300.0) -> "Cluster":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        py = [sys.executable, "-m"]
        if self.colocate_vocoder and self.shared_decoder:
            raise LaunchError("--shared-vocoder-decoder and --colocate-vocoder: the colocated decoder is the "
                              "worker's; a shared one is a process of its own")
        if self.colocate_vocoder and len(self.vocoder_ports) != 1:
            raise LaunchError("--colocate-vocoder runs one vocoder replica (its decoder is the worker's)")
        if self.gateway_port is not None and self.configs()[2].tls_dir:
            raise LaunchError("--http-port: the gateway it starts speaks plaintext gRPC, and scheduler.tls_dir "
                              "turns TLS on; start `chorus gateway --scheduler-tls-dir DIR` yourself instead")
        if self.engines:
            return self._start_tiers(env, timeout)
        worker, vocoder, scheduler = self.configs()
        self._tmp = tempfile.TemporaryDirectory(prefix="chorus-cluster-")
        tmp = self._tmp.name
        if self.temporary_voices and not scheduler.voice_store:
            scheduler = dataclasses.replace(scheduler, voice_store=f"sqlite:///{tmp}/voices.sqlite3")
        decoder_dir = os.path.join(tmp, "decoder")
        attach: list[str | None] = [None for _ in self.vocoder_ports]  # each replica's decoder directory
        worker = dataclasses.replace(worker, bind=f"tcp://{self.host}:{self.worker_port}")
        if self.curve:
            worker, scheduler = self._curve_keys(tmp, worker, scheduler)
        services = []
        if self.colocate_vocoder:
            worker.host_vocoder_decoder = attach[0] = decoder_dir
        elif self.shared_decoder:
            from vocoder_svc.decoder_client import front_dirs  # only where the vocoder's code is wanted
            services.append(Service("decoder", py + [
                "vocoder_svc.decode_process", "--fronts-dir", decoder_dir, "--fronts", str(len(self.vocoder_ports)),
                "--config-proto", write_proto(vocoder, os.path.join(tmp, "decoder.pb"))]))
            attach = front_dirs(decoder_dir, len(self.vocoder_ports))
        worker_file = write_worker_proto(worker, vocoder if self.colocate_vocoder else None,
                                         os.path.join(tmp, "worker.pb"))
        self.services = [Service("worker", py + ["chorus.colocate", "--config-proto", worker_file]), *services]
        vocoders = self._vocoder_services(vocoder, attach)
        self.services += vocoders
        omnivoice = self._omnivoice_services(tmp)
        self.services += omnivoice
        try:
            for s in self.services:
                s.start(self.echo, env, self.die_with_parent)
            deadline = time.monotonic() + timeout
            for s in self.services:
                s.wait_ready(max(1.0, deadline - time.monotonic()))
            scheduler = dataclasses.replace(scheduler, host=self.host, port=self.scheduler_port,
                                            worker=self.services[0].address, vocoder=[v.address for v in vocoders])
            if omnivoice:
                scheduler = dataclasses.replace(scheduler, omnivoice_worker=[omnivoice[0].address],
                                                omnivoice_vocoder=[v.address for v in omnivoice[1:]])
            self._scheduler = scheduler
            # the core drains, then waits for its frontends to relay the last audio (scheduler_svc.server)
            self.services.append(Service("scheduler", py + [
                "scheduler_svc.server", "--config-proto", write_proto(scheduler, os.path.join(tmp, "scheduler.pb"))],
                drain=scheduler.drain_seconds + 2 * DRAIN_MARGIN_S))
            self.services[-1].start(self.echo, env, self.die_with_parent)
            self.services[-1].wait_ready(max(1.0, deadline - time.monotonic()))
            self._start_gateway(scheduler.frontends, env, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _vocoder_services(self, vocoder: VocoderConfig, attach: list[str | None]) -> list[Service]:
        metrics = self.vocoder_metrics_ports or [0] * len(self.vocoder_ports)
        out = []
        for i, (port, mport, attached) in enumerate(zip(self.vocoder_ports, metrics, attach)):
            name = f"vocoder{i}" if len(self.vocoder_ports) > 1 else "vocoder"
            replica = dataclasses.replace(vocoder, host=self.host, port=port, metrics_port=mport,
                                          attach_decoder=attached)
            out.append(Service(name, [sys.executable, "-m", "vocoder_svc.server", "--config-proto",
                                      write_proto(replica, os.path.join(self._tmp.name, f"{name}.pb"))],
                               drain=replica.grace + DRAIN_MARGIN_S))
        return out

    def _start_tiers(self, env: dict[str, str], timeout: float) -> "Cluster":
        """workers and vocoders (with OmniVoice: a worker of it per engine, and its codec vocoders shared
        by all), then an engine core per worker, then the frontend tier on one port."""
        if self.colocate_vocoder or self.shared_decoder or self.colocate_omnivoice_codec:
            raise LaunchError("engines run with vocoders of their own: no colocated or shared decoder")
        worker, vocoder, scheduler = self.configs()
        self._tmp = tempfile.TemporaryDirectory(prefix="chorus-cluster-")
        tmp = self._tmp.name
        if self.temporary_voices and not scheduler.voice_store:
            scheduler = dataclasses.replace(scheduler, voice_store=f"sqlite:///{tmp}/voices.sqlite3")
        tier = scheduler  # the frontend tier's settings: the voice library is theirs
        if self.curve:
            worker, scheduler = self._curve_keys(tmp, worker, scheduler)
            tier, scheduler = self._frontend_curve_keys(tmp, scheduler)
        py = [sys.executable, "-m"]
        workers = []
        for i in range(self.engines):
            own = dataclasses.replace(worker, bind=f"tcp://{self.host}:0", device=_engine_device(worker.device, i))
            workers.append(Service(f"worker{i}", py + ["chorus.colocate", "--config-proto", write_worker_proto(
                own, None, os.path.join(tmp, f"worker{i}.pb"))]))
        clip_workers = [self._omnivoice_worker(tmp, f"omnivoice-worker{i}", i) for i in range(self.engines)
                        if self.omnivoice_worker is not None]
        vocoders = self._vocoder_services(vocoder, [None] * len(self.vocoder_ports))
        clip_vocoders = self._omnivoice_vocoders(tmp)
        self.services = [*workers, *clip_workers, *vocoders, *clip_vocoders]
        # scheduler.metrics_port P: the engines' cores serve /metrics on P, P+1, ..., the frontend tier
        # processes on the ports after them (one port per process: they share no registry)
        base = scheduler.metrics_port
        metrics = self.engine_metrics_ports or [base + i if base else 0 for i in range(self.engines)]
        try:
            self._start_all(self.services, env, timeout)
            engines = []
            for i, (w, mport) in enumerate(zip(workers, metrics)):
                # the frontends, not the cores, call the vocoders: an engine's core needs only its workers
                core = dataclasses.replace(scheduler, host=self.host, port=0, metrics_port=mport, worker=w.address,
                                           vocoder=[v.address for v in vocoders], frontends=0,
                                           frontend_link=f"tcp://{self.host}:0")
                if clip_workers:
                    core.omnivoice_worker = [clip_workers[i].address]
                engines.append(Service(f"engine{i}", py + ["scheduler_svc.server", "--config-proto", write_proto(
                    core, os.path.join(tmp, f"engine{i}.pb"))], drain=core.drain_seconds + DRAIN_MARGIN_S))
            self.services += engines
            self._start_all(engines, env, timeout)
            from scheduler_svc.server import _reserve_port  # noqa: PLC0415 - the cores' own way to share a port
            self._reservation, port = _reserve_port(self.host, self.scheduler_port)
            front = dataclasses.replace(tier, host=self.host, port=port, engines=[e.address for e in engines],
                                        vocoder=[v.address for v in vocoders])
            if clip_vocoders:
                front.omnivoice_vocoder = [v.address for v in clip_vocoders]
            front_metrics = [*(self.frontend_metrics_ports or [base + self.engines + i if base else 0
                                                               for i in range(self.frontend_tier)]),
                             *[0] * self.frontend_tier]
            fronts = [Service(f"frontend{i}", py + ["scheduler_svc.frontend_tier", "--config-proto", write_proto(
                dataclasses.replace(front, metrics_port=front_metrics[i]), os.path.join(tmp, f"frontend{i}.pb"))],
                drain=front.drain_seconds + DRAIN_MARGIN_S) for i in range(self.frontend_tier)]
            self.services += fronts
            self._start_all(fronts, env, timeout)
            self._start_gateway(self.frontend_tier, env, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_gateway(self, frontends: int, env: dict[str, str], timeout: float) -> None:
        """The HTTP gateway on gateway_port, translating to the public API (no-op without a port); a
        connection per frontend process at least, since the kernel gives each connection to one."""
        if self.gateway_port is None:
            return
        from gateway_svc.config import GatewayConfig  # noqa: PLC0415 - only where a gateway is asked for
        config = GatewayConfig(host=self.host, port=self.gateway_port, scheduler=self.address,
                               channels=max(GatewayConfig().channels, frontends))
        self.services.append(Service("gateway", [sys.executable, "-m", "gateway_svc.server", "--config-proto",
                                                 write_proto(config, os.path.join(self._tmp.name, "gateway.pb"))],
                                     drain=config.drain_seconds + DRAIN_MARGIN_S))
        self._start_all(self.services[-1:], env, timeout)

    def _start_all(self, services: list[Service], env: dict[str, str], timeout: float) -> None:
        for s in services:
            s.start(self.echo, env, self.die_with_parent)
        deadline = time.monotonic() + timeout
        for s in services:
            s.wait_ready(max(1.0, deadline - time.monotonic()))

    def _frontend_curve_keys(self, tmp: str, core: SchedulerConfig) -> tuple[SchedulerConfig, SchedulerConfig]:
        """(the frontend tier's config, the cores') with CURVE on the frontend link: a pair for the tier,
        whose public key the cores admit; the cores keep their worker-link pair."""
        from chorus.curve import generate
        keys = os.path.join(tmp, "curve")
        allowed = os.path.join(keys, "frontends")
        public, secret = generate(keys, "frontend")
        os.makedirs(allowed)
        os.replace(public, os.path.join(allowed, "frontend.key"))
        core_public = os.path.join(keys, "core.key")
        with open(core_public, "w") as f:  # the public half of the cores' pair
            import zmq.auth
            f.write(_public_key_file(zmq.auth.load_certificate(core.curve_secret_key)[0]))
        tier = dataclasses.replace(core, curve_secret_key=secret, engine_public_key=core_public)
        return tier, dataclasses.replace(core, frontend_curve_clients=allowed)

    def _curve_keys(self, tmp: str, worker: WorkerConfig, scheduler: SchedulerConfig):
        """worker and scheduler (and the OmniVoice worker) with a throwaway CURVE pair each, under tmp."""
        from chorus.curve import generate
        keys = os.path.join(tmp, "curve")
        clients = os.path.join(keys, "clients")
        worker_public, worker_secret = generate(keys, "worker")
        scheduler_public, scheduler_secret = generate(keys, "scheduler")
        os.makedirs(clients)
        os.replace(scheduler_public, os.path.join(clients, "scheduler.key"))
        if not scheduler.curve_secret_key:
            scheduler = dataclasses.replace(scheduler, curve_secret_key=scheduler_secret,
                                            worker_public_key=worker_public)
        if not worker.curve_secret_key:
            worker = dataclasses.replace(worker, curve_secret_key=worker_secret, curve_clients=clients)
        self._worker_curve = (worker_secret, clients)  # the OmniVoice worker's too
        return worker, scheduler

    def _omnivoice_services(self, tmp: str) -> list[Service]:
        """The OmniVoice worker, then its vocoder replicas; [] when OmniVoice is not served."""
        if self.omnivoice_worker is None:
            return []
        if self.colocate_omnivoice_codec and len(self.omnivoice_vocoder_ports) != 1:
            raise LaunchError("colocate_omnivoice_codec runs one OmniVoice codec replica (its forwards are the "
                              "OmniVoice worker's)")
        return [self._omnivoice_worker(tmp, "omnivoice-worker"), *self._omnivoice_vocoders(tmp)]

    def _omnivoice_codec_dir(self, tmp: str) -> str | None:
        """Where the OmniVoice worker serves the codec it hosts; None when the codec has a process of its own."""
        return os.path.join(tmp, "omnivoice-codec") if self.colocate_omnivoice_codec else None

    def _omnivoice_worker(self, tmp: str, name: str, engine: int | None = None) -> Service:
        """An OmniVoice worker (engine: the index of the engine it serves, whose GPU "cuda" means)."""
        device = self.omnivoice_worker.device
        hosted = self._omnivoice_codec_dir(tmp) if engine is None else None
        worker = dataclasses.replace(self.omnivoice_worker, bind=f"tcp://{self.host}:0", host_vocoder_decoder=hosted,
                                     device=device if engine is None else _engine_device(device, engine))
        if self._worker_curve and not worker.curve_secret_key:
            worker = dataclasses.replace(worker, curve_secret_key=self._worker_curve[0],
                                         curve_clients=self._worker_curve[1])
        codec = (self.omnivoice_vocoder or VocoderConfig()) if hosted else None
        return Service(name, [sys.executable, "-m", "chorus.colocate", "--config-proto", write_worker_proto(
            worker, codec, os.path.join(tmp, f"{name}.pb"))])

    def _omnivoice_vocoders(self, tmp: str) -> list[Service]:
        """The OmniVoice codec's vocoder replicas, one per port; [] when OmniVoice is not served."""
        if self.omnivoice_worker is None:
            return []
        vocoder = self.omnivoice_vocoder or VocoderConfig()
        out = []
        metrics = self.omnivoice_vocoder_metrics_ports or [0] * len(self.omnivoice_vocoder_ports)
        for i, (port, mport) in enumerate(zip(self.omnivoice_vocoder_ports, metrics)):
            name = f"omnivoice-vocoder{i}" if len(self.omnivoice_vocoder_ports) > 1 else "omnivoice-vocoder"
            replica = dataclasses.replace(vocoder, host=self.host, port=port, metrics_port=mport,
                                          attach_decoder=self._omnivoice_codec_dir(tmp))
            out.append(Service(name, [sys.executable, "-m", "vocoder_svc.server", "--config-proto",
                                      write_proto(replica, os.path.join(tmp, f"{name}.pb"))],
                               drain=replica.grace + DRAIN_MARGIN_S))
        return out

    def restart_scheduler(self, timeout: float = 300.0) -> Service:
        """Start the scheduler again, on the port it served (the workers and vocoders it used go on)."""
        old = self.service("scheduler")
        old.stop()
        port = int(old.address.rpartition(":")[2])
        argv = old.argv[:-1] + [write_proto(dataclasses.replace(self._scheduler, port=port), old.argv[-1])]
        new = Service("scheduler", argv)
        self.services[self.services.index(old)] = new
        new.start(self.echo, dict(os.environ, PYTHONUNBUFFERED="1"), self.die_with_parent)
        new.wait_ready(timeout)
        return new

    def supervise(self, stop: threading.Event, max_delay: float = 30.0, healthy_after: float = 60.0) -> str | None:
        """Watch the services until `stop` is set (None) or one other than the scheduler exits (its
        name). A scheduler that exits (a frontend or its core died) is started again on its port, after
        a delay that doubles from 1 s up to max_delay while it keeps failing within healthy_after s."""
        failures, last = 0, -math.inf
        while not stop.wait(0.5):
            dead = [s for s in self.services if s.proc is not None and s.proc.poll() is not None]
            if any(s.name != "scheduler" for s in dead):
                return next(s.name for s in dead if s.name != "scheduler")
            if not dead:
                continue
            failures = 1 if time.monotonic() - last > healthy_after else failures + 1
            delay = min(max_delay, 2.0 ** (failures - 1))
            self.restarts += 1
            print(f"scheduler exited with code {dead[0].proc.returncode}; restart {self.restarts} in {delay:g} s",
                  flush=True)
            if stop.wait(delay):
                return None
            try:
                self.restart_scheduler()
            except LaunchError as e:
                print(f"scheduler restart {self.restarts} failed: {e}", flush=True)
            last = time.monotonic()
        return None

    def stop(self) -> None:
        """SIGTERM each service, each drained before the next: the scheduler (frontends, then core),
        the vocoders, the workers (the reverse of the start order)."""
        for s in reversed(self.services):
            s.stop()
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _engine_device(device: str, engine: int) -> str:
    """An engine's process's device: "cuda" is a GPU per engine (engine i's on cuda:i)."""
    return f"cuda:{engine}" if device == "cuda" else device


def _public_key_file(public: bytes) -> str:
    """A zmq.auth public key file's text for a z85 public key."""
    return f"curve\n    public-key = \"{public.decode()}\"\n"


def write_worker_proto(worker: WorkerConfig, hosted: VocoderConfig | None, path: str) -> str:
    """The worker's --config-proto file (chorus.v1.WorkerProcessConfig): its config, and the vocoder's
    for the decoder it hosts (worker.host_vocoder_decoder)."""
    from chorus.config import to_proto
    from chorus.v1 import config_pb2
    msg = config_pb2.WorkerProcessConfig(worker=to_proto(worker))
    if hosted is not None:
        msg.vocoder.CopyFrom(to_proto(hosted))
    with open(path, "wb") as fh:
        fh.write(msg.SerializeToString())
    return path

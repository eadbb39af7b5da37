"""Starts the three services as real local processes and stops them.

Used by `chorus up` / `chorus demo` and by the end-to-end tests. Each service
prints one `... ready on ADDRESS` line when it serves; the launcher waits for
it (so ephemeral ports work) and relays every line with a prefix.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field

READY = re.compile(r"\bready on (\S+)")


class LaunchError(RuntimeError):
    pass


def process_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def child_pids(pid: int) -> list[int]:
    """The live child processes of pid (Linux /proc; [] elsewhere)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


@dataclass
class Service:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    address: str | None = None
    lines: list[str] = field(default_factory=list)
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self, echo: bool, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, env=env, start_new_session=True)
        threading.Thread(target=self._pump, args=(echo,), daemon=True).start()

    def _pump(self, echo: bool) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if len(self.lines) > 2000:
                del self.lines[:1000]
            if echo:
                print(f"[{self.name}] {line}", flush=True)
            m = READY.search(line)
            if m and not self._ready.is_set():
                self.address = m.group(1)
                self._ready.set()
        self._ready.set()  # exited: wake the waiter, which checks the return code

    def wait_ready(self, timeout: float) -> str:
        if not self._ready.wait(timeout):
            raise LaunchError(f"{self.name} not ready after {timeout:.0f}s:\n" + "\n".join(self.lines[-30:]))
        if self.address is None:
            raise LaunchError(f"{self.name} exited with code {self.proc.poll()}:\n" + "\n".join(self.lines[-30:]))
        return self.address

    def cpu_seconds(self, children: bool = True) -> float | None:
        """CPU time (user + system, all threads) the process has used so far, with its live child
        processes' (the scheduler's frontends) unless children=False; None off Linux."""
        if self.proc is None:
            return None
        pids = [self.proc.pid] + (child_pids(self.proc.pid) if children else [])
        total = [process_cpu_seconds(p) for p in pids]
        return None if total[0] is None else sum(t for t in total if t is not None)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def add_service_flags(p) -> None:
    """The model, codec, device and dtype flags that service_args turns into service flags
    (chorus up / demo, chorus bench --launch); p is a parser or an argument group."""
    p.add_argument("--model", metavar="DIR", help="MOSS-TTS Local v1.5 checkpoint directory (default: tiny preset)")
    p.add_argument("--codec", metavar="DIR", help="MOSS-Audio-Tokenizer directory (default: tiny preset)")
    p.add_argument("--device", default="cpu", help="torch device for the worker and vocoder (cpu, cuda, cuda:1)")
    p.add_argument("--vocoder-device", default=None, metavar="DEVICE",
                   help="put the vocoder on this device instead (e.g. cuda:1: one GPU per service)")
    p.add_argument("--dtype", default=None, help="compute dtype (default float32 on cpu, bfloat16 otherwise)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="extra gpu_worker flag, repeatable; attach with '=': --worker-arg=--kv-slots=65536")
    p.add_argument("--vocoder-arg", action="append", default=[], metavar="FLAG",
                   help="extra vocoder flag, repeatable (e.g. --vocoder-arg=--step-frames=5)")
    p.add_argument("--scheduler-arg", action="append", default=[], metavar="FLAG",
                   help="extra scheduler flag, repeatable (e.g. --scheduler-arg=--max-queue=1024)")
    p.add_argument("--colocate-vocoder", nargs="?", choices=("auto", "on", "off"), const="on", default="auto",
                   help="run the vocoder's decoder inside the worker's process (gpu_worker "
                        "--host-vocoder-decoder, vocoder --attach-decoder): on one GPU the two then share one "
                        "CUDA context instead of taking turns in time slices, and the vocoder decodes in "
                        "--first-chunk-frames steps unless --vocoder-arg sets --step-frames (one H200, W1 c16: "
                        "time to first audio p50 106 ms as two processes, 76-80 colocated). One vocoder "
                        "replica, on the worker's device. auto (the default) = on when the worker and one "
                        "vocoder replica share a CUDA device")
    p.add_argument("--shared-vocoder-decoder", action="store_true",
                   help="the --vocoders replicas share one decoder process (vocoder_svc.decode_process "
                        "--fronts-dir; each replica attaches with --attach-decoder): one CUDA context and one "
                        "codec session, whose --slots all replicas share, with the gRPC work spread over the "
                        "replicas' processes. For a vocoder GPU of its own at high load, where one vocoder process "
                        "cannot feed the GPU and two replicas' contexts take turns on it (benchmarks/README.md, "
                        "session 13)")


def _same_device(a: str, b: str) -> bool:
    norm = lambda d: d + ":0" if d == "cuda" else d  # noqa: E731 - the current device, as the services pick it
    return norm(a) == norm(b)


def _flag_value(args: list[str], name: str) -> str | None:
    """The value of flag `name` in args (`--x=v` or `--x v`; the last one wins), or None."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def colocation(choice: str, device: str, vocoder_device: str | None, replicas: int,
               vocoder_args: list[str]) -> tuple[bool, list[str]]:
    """(colocate?, the vocoder's flags) for --colocate-vocoder auto|on|off.

    On the worker's device (colocated or not) the vocoder launches a step ahead only when it carries
    half its slots (--launch-ahead-streams), unless its flags say otherwise: its server's default, every
    step, is for a GPU of its own, and beside the worker a queued step delays the worker's kernels and
    new streams' first chunks (one H200, W1 c16: ~50 ms of time to first audio, session 5).
    Colocated, the decoder runs in --first-chunk-frames steps (--step-frames) unless its flags say
    otherwise: new streams' first chunks then share steps with the steady ones instead of waiting."""
    vdev = vocoder_device or device
    shared = _same_device(device, vdev)
    on = choice == "on" or (choice == "auto" and device.startswith("cuda") and replicas == 1 and shared)
    flags = list(vocoder_args)
    if (shared or on) and _flag_value(flags, "--launch-ahead-streams") is None:
        slots = int(_flag_value(flags, "--slots") or 64)  # 64: vocoder_svc.server's --slots default
        flags += ["--launch-ahead-streams", str(max(1, slots // 2))]
    if on and _flag_value(flags, "--step-frames") is None:
        first = _flag_value(flags, "--first-chunk-frames") or "5"  # vocoder_svc.server's default
        flags += ["--step-frames", first]
    return on, flags


def service_args(model: str | None, codec: str | None, device: str, dtype: str | None,
                 vocoder_device: str | None = None) -> tuple[list[str], list[str], list[str]]:
    """(worker, vocoder, scheduler) flags for a model/codec on devices: the vocoder on its own GPU
    with vocoder_device (per-service scaling on one host), else beside the worker."""
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    worker = ["--device", device, "--dtype", dtype]
    vocoder = ["--device", vocoder_device or device, "--dtype", dtype]
    scheduler: list[str] = []
    if model:
        worker += ["--model", model]
        scheduler += ["--tokenizer", model]
    if codec:
        vocoder += ["--codec", codec]
    return worker, vocoder, scheduler


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for a service started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def read_metrics(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> dict[str, float]:
    """A service's Prometheus samples without labels ({name: value}), e.g. counters' `_total`
    and histograms' `_count` / `_sum`. Raises OSError when nothing answers."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name and not name.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


@dataclass
class Cluster:
    """worker + vocoder(s) + scheduler on this machine."""

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
    # The vocoder replicas in front of one decoder process: see vocoder_svc.decode_process.host_main.
    shared_decoder: bool = False
    services: list[Service] = field(default_factory=list)
    _decoder_dir: tempfile.TemporaryDirectory | None = None

    @property
    def address(self) -> str:
        return self.services[-1].address

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def start(self, timeout: float = 300.0) -> "Cluster":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        py = [sys.executable, "-m"]
        worker_args, vocoder_args = list(self.worker_args), list(self.vocoder_args)
        if self.colocate_vocoder and self.shared_decoder:
            raise LaunchError("--shared-vocoder-decoder and --colocate-vocoder: the colocated decoder is the "
                              "worker's; a shared one is a process of its own")
        if self.colocate_vocoder and len(self.vocoder_ports) != 1:
            raise LaunchError("--colocate-vocoder runs one vocoder replica (its decoder is the worker's)")
        attach = [[] for _ in self.vocoder_ports]  # each replica's extra flags
        services = []
        if self.colocate_vocoder or self.shared_decoder:
            self._decoder_dir = tempfile.TemporaryDirectory(prefix="chorus-decoder-")
            decoder_dir = self._decoder_dir.name
        if self.colocate_vocoder:
            worker_args += ["--host-vocoder-decoder", decoder_dir, "--vocoder-decoder-args", shlex.join(vocoder_args)]
            attach = [["--attach-decoder", decoder_dir]]
        elif self.shared_decoder:
            from vocoder_svc.decode_process import front_dirs  # only where the vocoder's code is wanted
            services.append(Service("decoder", py + ["vocoder_svc.decode_process", "--fronts-dir", decoder_dir,
                                                     "--fronts", str(len(self.vocoder_ports)), *vocoder_args]))
            attach = [["--attach-decoder", d] for d in front_dirs(decoder_dir, len(self.vocoder_ports))]
        worker = Service("worker", py + ["gpu_worker.server", "--bind", f"tcp://{self.host}:{self.worker_port}",
                                         *worker_args])
        self.services = [worker, *services]
        metrics = self.vocoder_metrics_ports or [0] * len(self.vocoder_ports)
        vocoders = [Service(f"vocoder{i}" if len(self.vocoder_ports) > 1 else "vocoder",
                            py + ["vocoder_svc.server", "--host", self.host, "--port", str(port), "--metrics-port",
                                  str(mport), *vocoder_args, *extra])
                    for i, (port, mport, extra) in enumerate(zip(self.vocoder_ports, metrics, attach))]
        self.services += vocoders
        try:
            for s in self.services:
                s.start(self.echo, env)
            deadline = time.monotonic() + timeout
            for s in self.services:
                s.wait_ready(max(1.0, deadline - time.monotonic()))
            vocoder_flags = [f for v in vocoders for f in ("--vocoder", v.address)]
            scheduler = Service("scheduler", py + ["scheduler_svc.server", "--host", self.host, "--port",
                                                   str(self.scheduler_port), "--worker", worker.address,
                                                   *vocoder_flags, *self.scheduler_args])
            self.services.append(scheduler)
            scheduler.start(self.echo, env)
            scheduler.wait_ready(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()
        if self._decoder_dir is not None:
            self._decoder_dir.cleanup()
            self._decoder_dir = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

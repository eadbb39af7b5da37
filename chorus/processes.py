"""Local service processes: start one, wait for its `... ready on ADDRESS` line, relay its output,
stop it within its drain; and the /proc and /metrics reads that tests and benchmarks take of them."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
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


def _die_with_parent() -> None:
    """In a service's process before exec: SIGTERM when the thread that started it ends, so a
    launcher killed without a chance to clean up (SIGKILL, OOM) leaves no service behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Service:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    address: str | None = None
    lines: list[str] = field(default_factory=list)
    drain: float = 10.0  # seconds it may take to exit after SIGTERM (its drain) before it is killed
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self, echo: bool, env: dict[str, str], die_with_parent: bool = False) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent if die_with_parent else None)
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

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, and a kill if it has not exited after `timeout` (None: its drain) seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.drain if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for a service started next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports nothing listens on right now: all bound at once, so two
    services started next never get the same one (free_port twice may return one port twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def read_metrics(port: int, host: str = "127.0.0.1", timeout: float = 5.0,
                 labelled: bool = False) -> dict[str, float]:
    """A service's Prometheus samples without labels ({name: value}), e.g. counters' `_total`
    and histograms' `_count` / `_sum`; labelled: those with labels too, each name summed over its
    label sets (a model's and every other model's steps together). Raises OSError when nothing
    answers."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if not sample or sample.startswith("#"):
            continue
        name, brace, _ = sample.partition("{")
        if brace and not labelled:
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out

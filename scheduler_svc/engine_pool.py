"""The engines a frontend serves from: one link (CoreClient) per scheduler core, and the pick per request.

A frontend the core started has one engine, its parent, on an ipc socket. A frontend tier process
(`chorus frontend --engines ...`) has every engine it is given: fixed tcp:// endpoints, or
dns:///NAME:PORT, looked up every few seconds (a Kubernetes headless Service lists the ready
engine pods), engines joining and leaving as the answer changes. An engine that leaves the answer
takes no new requests and is dropped once its open ones end (a draining pod finishes its streams);
one whose link drops ends its open requests UNAVAILABLE at once (CoreClient).

The pool answers what the frontend asks of "the core" (submit, abort, pause, report, prefix
eviction, health), so the API code is the same for one engine or many; scheduler_svc/engine_picker.py picks.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import socket
from dataclasses import dataclass

import numpy as np

from chorus.v1 import frontend_pb2, tts_pb2, worker_pb2
from scheduler_svc import engine_picker, metrics
from scheduler_svc.core_client import CanvasTicket, CoreClient, CoreUnavailable, Ticket
from scheduler_svc.request import QueueFull, Unavailable

log = logging.getLogger("chorus.scheduler")


def affinity_key(request: tts_pb2.SynthesizeRequest, owner: str = "") -> bytes | None:
    """What requests that share a prompt prefix share: the first reference's voice id (with its
    owner), else a hash of its codes or audio, else the continuation's; None without a reference."""
    refs = list(request.references) + ([request.continuation] if request.HasField("continuation") else [])
    for ref in refs[:1]:
        kind = ref.WhichOneof("source")
        if kind == "voice_id":
            return f"voice\0{owner}\0{ref.voice_id}".encode()
        if kind == "codes":
            return b"codes\0" + hashlib.blake2b(ref.codes.SerializeToString(), digest_size=16).digest()
        if kind == "audio":
            return b"audio\0" + hashlib.blake2b(ref.audio.data, digest_size=16).digest()
    return None


def resolve(spec: str, port_default: int = 0) -> set[str]:
    """The tcp:// endpoints of one engine spec: itself, or every address dns:///NAME:PORT names.
    OSError when the name does not resolve."""
    if not spec.startswith("dns:///"):
        return {spec}
    name, _, port = spec[len("dns:///"):].rpartition(":")
    infos = socket.getaddrinfo(name.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return {f"tcp://[{ai[4][0]}]:{port}" if ai[0] == socket.AF_INET6 else f"tcp://{ai[4][0]}:{port}"
            for ai in infos}


def _count(event: str, ttfa_s: float, outcome: str) -> None:
    """A call's report in this process's own metrics (served by a frontend tier process)."""
    if event == "start":
        metrics.FRONTEND_ACTIVE_STREAMS.inc()
    elif event == "first_audio":
        metrics.FRONTEND_TTFA_SECONDS.observe(ttfa_s)
    elif event == "end":
        metrics.FRONTEND_ACTIVE_STREAMS.dec()
        metrics.FRONTEND_REQUESTS.labels(outcome or "cancelled").inc()


def _models(hello: frontend_pb2.CoreHello) -> set[str]:
    """The models an engine schedules: its worker's, and its canvas workers'."""
    return {hello.worker.model_name, *(h.model_name for h in hello.canvas_workers)}


@dataclass
class _Stream:
    """A call's reports, held until its engine is known (so one engine counts it start to end)."""
    engine: CoreClient | None = None


_stream: contextvars.ContextVar[_Stream | None] = contextvars.ContextVar("engine_stream", default=None)


class EnginePool:
    def __init__(self, specs: list[str], max_message_bytes: int = 0, curve_keys: tuple[str, str] | None = None,
                 refresh: float = 5.0, slack: float = 0.25, margin: float = 2.0, parent: bool = False):
        """specs: engine endpoints or dns:///NAME:PORT (a comma-separated list in one item is split).
        parent: the one engine is the core that started this frontend, which drains when it drains."""
        self.specs = [s.strip() for item in specs for s in item.split(",") if s.strip()]
        if not self.specs:
            raise ValueError("no engines: give at least one endpoint or dns:///NAME:PORT")
        self.max_message_bytes, self.curve_keys = max_message_bytes, curve_keys
        self.parent = parent
        self.refresh, self.slack, self.margin = refresh, slack, margin
        self.engines: dict[str, CoreClient] = {}     # endpoint -> link, all that take requests
        self._retiring: dict[str, CoreClient] = {}   # left the DNS answer: closed once idle
        self._owner: dict[Ticket | CanvasTicket, CoreClient] = {}
        self.hello: frontend_pb2.CoreHello | None = None  # the first engine's: every engine must serve its model
        self.health_changed = asyncio.Event()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._reported_ready = False
        if not parent:  # a frontend tier process's /metrics (scheduler_svc/frontend_tier.py)
            metrics.FRONTEND_ENGINES.set_function(lambda: len(self._live()))

    # ---- membership --------------------------------------------------------------------------
    async def connect(self, timeout: float = 600.0) -> frontend_pb2.CoreHello:
        """Start following the engines; the first one's hello, once one answers."""
        self._tasks.append(asyncio.get_running_loop().create_task(self._follow()))
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            raise CoreUnavailable(f"no scheduler engine of {', '.join(self.specs)} answered within "
                                  f"{timeout:.0f}s") from None
        return self.hello

    async def _follow(self) -> None:
        while True:
            wanted: set[str] = set()
            for spec in self.specs:
                try:
                    wanted |= await asyncio.to_thread(resolve, spec)
                except (OSError, ValueError) as e:  # DNS out for a moment: keep what is there
                    log.warning("engines %s: %s; keeping the engines as they are", spec, e)
                    wanted |= set(self.engines)
            for endpoint in wanted - set(self.engines):
                self._add(endpoint)
            for endpoint in set(self.engines) - wanted:
                log.info("engine %s left; it takes no new requests", endpoint)
                self._retiring[endpoint] = self.engines.pop(endpoint)
                self.health_changed.set()
            for endpoint, client in list(self._retiring.items()):
                if not client.in_flight or not client.up:
                    client.close()
                    del self._retiring[endpoint]
            await asyncio.sleep(self.refresh)

    def _add(self, endpoint: str) -> None:
        client = self._retiring.pop(endpoint, None)
        if client is None:
            client = CoreClient(endpoint, max_message_bytes=self.max_message_bytes, curve_keys=self.curve_keys)
            client.health_changed = self.health_changed
            self._tasks.append(asyncio.get_running_loop().create_task(self._hello(client)))
        self.engines[endpoint] = client
        log.info("engine %s joined", endpoint)

    async def _hello(self, client: CoreClient) -> None:
        while client.hello is None:
            try:
                hello = await client.connect(timeout=30.0)
            except CoreUnavailable:
                await asyncio.sleep(1.0)
                continue
            if self.hello is None:
                self.hello = hello
            elif hello.worker.model_name != self.hello.worker.model_name:
                log.error("engine %s serves %s, not %s: it gets no requests", client.endpoint,
                          hello.worker.model_name, self.hello.worker.model_name)
                return
        if self._reported_ready:
            client.report("ready")
        self._ready.set()
        self.health_changed.set()

    def _live(self, model: str | None = None) -> list[CoreClient]:
        """Engines that take requests (for model: that schedule it and whose worker for it answers), by
        endpoint. An engine whose OmniVoice worker is down still takes MOSS requests, and the reverse."""
        if self.hello is None:
            return []
        model = model or self.hello.worker.model_name
        return [c for _, c in sorted(self.engines.items())
                if c.up and not c.draining and c.hello.worker.model_name == self.hello.worker.model_name
                and model in _models(c.hello) and model not in c.down]

    def _pick(self, key: bytes | None, model: str | None, refused: set[str]) -> CoreClient | None:
        live = {c.endpoint: c for c in self._live(model) if c.endpoint not in refused}
        name = engine_picker.pick(key, {e: c.in_flight + c.queued for e, c in live.items()}, self.slack, self.margin)
        return live.get(name)

    # ---- what a frontend asks of the core ----------------------------------------------------
    @property
    def down(self) -> set[str]:
        """Models no live engine serves."""
        if self.hello is None:
            return set()
        return {m for m in _models(self.hello) if not self._live(m)}

    @property
    def draining(self) -> bool:
        """The parent core drains (a frontend tier's engines drain on their own: it picks others)."""
        return self.parent and any(c.draining for c in self.engines.values())

    @property
    def up(self) -> bool:
        return bool(self._live())

    @property
    def worker(self) -> worker_pb2.Hello:
        return self.hello.worker

    def fits(self, prompt_len: int) -> bool:
        return -(-(prompt_len + 1) // self.hello.page_size) <= self.hello.kv_pages

    @property
    def broken(self) -> str:
        """Why no engine can be used (empty while one can): each link stopped reading."""
        clients = list(self.engines.values())
        if not clients or not all(c.broken for c in clients):
            return ""
        return "; ".join(f"{c.endpoint}: {c.broken}" for c in clients)

    async def submit(self, prompt_rows: np.ndarray, sampling: worker_pb2.SamplingConfig, max_frames: int,
                     key: bytes | None = None) -> Ticket:
        """On the engine the picker gives key; one that refuses, or whose link drops, passes the request to
        the next. QueueFull when every live engine's queue is full, Unavailable when none is live."""
        return await self._place(key, None, lambda c: c.submit(prompt_rows, sampling, max_frames))

    async def submit_canvas(self, model: str, canvas: worker_pb2.CanvasStart) -> CanvasTicket:
        return await self._place(None, model or None, lambda c: c.submit_canvas(model, canvas))

    async def _place(self, key: bytes | None, model: str | None, submit):
        refused: set[str] = set()
        full: QueueFull | None = None
        unavailable: Unavailable | None = None  # the last engine's refusal says why (a drain, a dead worker)
        while (client := self._pick(key, model, refused)) is not None:
            try:
                ticket = await submit(client)
            except QueueFull as e:
                full = full or e
            except Unavailable as e:
                unavailable = e
            else:
                self._owner[ticket] = client
                metrics.FRONTEND_ENGINE_PICKS.labels(client.endpoint).inc()
                stream = _stream.get()
                if stream is not None and stream.engine is None:
                    stream.engine = client
                    client.report("start")
                return ticket
            refused.add(client.endpoint)
        if full is not None:
            raise full
        raise unavailable or Unavailable(self.refusal(model or self.hello.worker.model_name))

    def refusal(self, model: str) -> str:
        """Why no engine takes a request for model now (it is in `down`): a drain, or no worker answers."""
        if not any(c.draining for c in self.engines.values()):
            return f"the {model} worker is not answering; retry later"
        if self.parent:
            return ("the scheduler is draining (shutting down for a restart or scale-down) and takes no new "
                    "request; retry: another replica takes it")
        return (f"no scheduler engine takes {model} requests: they are draining (shutting down for a restart or "
                "scale-down) or not answering; retry: an engine that joins takes it")

    def pause(self, t: Ticket, paused: bool) -> None:
        client = self._owner.get(t)
        if client is not None:
            client.pause(t, paused)

    def abort(self, t: Ticket | CanvasTicket) -> None:
        client = self._owner.pop(t, None)
        if client is not None:
            client.abort(t)

    def report(self, event: str, ttfa_s: float = 0.0, outcome: str = "") -> None:
        """To this process's metrics, and to the engine that serves the call (its /metrics counts it):
        start waits for the pick; a call that never reached an engine is counted, start and end, by the
        first live one."""
        _count(event, ttfa_s, outcome)
        if event == "ready":
            self._reported_ready = True
            for c in self._live():
                c.report("ready")
            return
        if event == "start":
            _stream.set(_Stream())
            return
        if event == "refused":  # a caller's limit refused the call before it reached an engine
            live = self._live()
            if live:
                live[0].report(event, outcome=outcome)
            return
        stream = _stream.get() or _Stream()
        engine = stream.engine
        if engine is None and event == "end":
            live = self._live()
            if not live:
                return
            engine = stream.engine = live[0]
            engine.report("start")
        if engine is not None:
            engine.report(event, ttfa_s=ttfa_s, outcome=outcome)

    # ---- voices live in the frontends' store (scheduler_svc/voices.py) -------------------------
    def evict_prefix(self, rows: np.ndarray, shared_rows: int) -> None:
        """A deleted voice's prompt prefix: every live engine frees the cached rows that start with it."""
        for engine in self._live():
            engine.evict_prefix(rows, shared_rows)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for c in (*self.engines.values(), *self._retiring.values()):
            c.close()
        self.engines.clear()
        self._retiring.clear()

"""A frontend's end of the link to the scheduler core (DEALER -> the core's ROUTER).

What the Synthesize handler needs of the scheduler, over ZeroMQ: submit a
prompt and get a Ticket whose `events` queue receives the request's
FrameEvents and its FinishEvent / ErrorEvent (the same events the audio relay
reads in-process), or submit an OmniVoice canvas and get a CanvasTicket whose
`done` future receives its CanvasDone; abort either; and evict a deleted
voice's prefix from the core's radix cache.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from chorus import curve
from chorus.v1 import frontend_pb2, worker_pb2
from scheduler_svc.canvas_scheduler import UNAVAILABLE as CANVAS_UNAVAILABLE
from scheduler_svc.request import ErrorEvent, FinishEvent, FrameEvent, QueueFull, Unavailable
from chorus.wire import matrix_array, rows_matrix


class CoreUnavailable(Unavailable):
    """The core did not answer, or the link to it dropped."""


@dataclass(eq=False)
class Ticket:
    """A request as its frontend sees it."""
    ticket: int
    prompt_len: int
    id: int = 0                      # the scheduler's request id
    loaded: bool = False             # the scheduler was under load when it took the request
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_accepted: float = field(default_factory=time.monotonic)
    finished: frontend_pb2.Finished | None = None  # set with the FinishEvent / ErrorEvent
    t_first_frame: float | None = None
    t_first_chunk: float | None = None  # the first audio chunk's frames went to the vocoder (the relay sets it)
    t_last_frame: float | None = None   # the relay saw the last frame
    max_audio_lag: float = 0.0          # seconds: the relay's longest chunk wait for its audio


@dataclass(eq=False)
class CanvasTicket:
    """An OmniVoice canvas as its frontend sees it."""
    ticket: int
    id: int = 0                      # the scheduler's request id
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    t_accepted: float = field(default_factory=time.monotonic)
    t_done: float | None = None


class CoreClient:
    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context | None = None, max_message_bytes: int = 0,
                 curve_keys: tuple[str, str] | None = None):
        """max_message_bytes: a larger message from the core drops the link (0 = no limit); curve_keys:
        (this frontend's secret key file, the core's public key file) to talk CURVE."""
        self.endpoint = endpoint
        self._sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.limit_size(self._sock, max_message_bytes)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # a core on another host that goes silent counts as gone after 3 s (ZMTP heartbeats)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if curve_keys:
            curve.connect_as(self._sock, *curve_keys)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self.connected = False                  # the link is up (a handshake since the last drop)
        self.queued = 0                         # the core's waiting MOSS requests, as it last said
        self._watcher: asyncio.Task | None = None
        self._calls = itertools.count(1)
        self._tickets = itertools.count(1)
        self._answers: dict[int, asyncio.Future] = {}
        self._open: dict[int, Ticket | CanvasTicket] = {}
        self._reader: asyncio.Task | None = None
        self.hello: frontend_pb2.CoreHello | None = None
        self.down: set[str] = set()            # models none of whose workers answers (the core's WorkerHealth)
        self.draining = False                  # the core is draining: it takes no new requests
        self.health_changed = asyncio.Event()   # set on every WorkerHealth

    # ---- transport ------------------------------------------------------------------------------
    def _send(self, msg: frontend_pb2.FrontendMessage) -> None:
        self._sock.send(msg.SerializeToString())

    async def _call(self, msg: frontend_pb2.FrontendMessage, timeout: float = 30.0) -> frontend_pb2.CoreMessage:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
            self._watcher = asyncio.get_running_loop().create_task(self._watch_link())
        msg.call = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self._answers[msg.call] = fut
        self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as e:
            raise CoreUnavailable(f"the scheduler core at {self.endpoint} did not answer within {timeout:.0f}s") from e
        finally:
            self._answers.pop(msg.call, None)

    async def _read_loop(self) -> None:
        while True:
            msg = frontend_pb2.CoreMessage.FromString(await self._sock.recv())
            kind = msg.WhichOneof("kind")
            if kind == "progress":
                self._progress(msg.progress)
                continue
            if kind == "canvas_done":
                self._canvas_done(msg.canvas_done)
                continue
            if kind == "health":
                if set(msg.health.down) != self.down or msg.health.draining != self.draining:
                    self.down = set(msg.health.down)
                    self.draining = msg.health.draining
                    self.health_changed.set()
                self.queued = msg.health.queued
                continue
            fut = self._answers.get(msg.call)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def _watch_link(self) -> None:
        """Follows the connection: when it drops (the core died, or its host went silent), every open
        request and call ends UNAVAILABLE at once, never a hang; when it is back (the same core, or its
        replacement), hello again."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.connected and self.hello is not None:
                    asyncio.get_running_loop().create_task(self._rehello())
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self._fail_open(f"the link to the scheduler core at {self.endpoint} dropped")
            self.health_changed.set()

    async def _rehello(self) -> None:
        try:
            self.hello = (await self._call(frontend_pb2.FrontendMessage(hello=frontend_pb2.CoreHelloRequest()),
                                           10.0)).hello
        except CoreUnavailable:
            pass
        self.health_changed.set()

    def _fail_open(self, why: str) -> None:
        for fut in self._answers.values():
            if not fut.done():
                fut.set_exception(CoreUnavailable(why))
        open_, self._open = self._open, {}
        for t in open_.values():
            if isinstance(t, CanvasTicket):
                if not t.done.done():
                    t.done.set_result(frontend_pb2.CanvasDone(ticket=t.ticket, error=f"{CANVAS_UNAVAILABLE}: {why}"))
            else:
                t.finished = frontend_pb2.Finished(ticket=t.ticket, error=why, unavailable=True)
                t.events.put_nowait(ErrorEvent(why, True))

    @property
    def up(self) -> bool:
        """Requests can go to this core: linked, hello answered, the link reading."""
        return self.connected and self.hello is not None and not self.broken

    @property
    def in_flight(self) -> int:
        """Requests of this frontend open on the core."""
        return len(self._open)

    def _progress(self, p: frontend_pb2.Progress) -> None:
        if p.tickets:
            rows = matrix_array(p.rows)
            for ticket, index, row in zip(p.tickets, p.indices, rows):
                t = self._open.get(ticket)
                if t is not None:
                    if t.t_first_frame is None:
                        t.t_first_frame = time.monotonic()
                    t.events.put_nowait(FrameEvent(index, row))
        for done in p.finished:
            t = self._open.pop(done.ticket, None)
            if t is not None:
                t.finished = done
                t.events.put_nowait(ErrorEvent(done.error, done.unavailable) if done.error else FinishEvent(done.reason))

    def _canvas_done(self, done: frontend_pb2.CanvasDone) -> None:
        t = self._open.pop(done.ticket, None)
        if isinstance(t, CanvasTicket) and not t.done.done():
            t.t_done = time.monotonic()
            t.done.set_result(done)

    # ---- the scheduler -------------------------------------------------------------------------
    async def connect(self, timeout: float = 600.0) -> frontend_pb2.CoreHello:
        self.hello = (await self._call(frontend_pb2.FrontendMessage(hello=frontend_pb2.CoreHelloRequest()),
                                       timeout)).hello
        return self.hello

    @property
    def worker(self) -> worker_pb2.Hello:
        return self.hello.worker

    def fits(self, prompt_len: int) -> bool:
        """Whether a prompt could ever be admitted (with the whole KV cache free)."""
        return -(-(prompt_len + 1) // self.hello.page_size) <= self.hello.kv_pages

    async def submit(self, prompt_rows: np.ndarray, sampling: worker_pb2.SamplingConfig,
                     max_frames: int) -> Ticket:
        t = Ticket(next(self._tickets), prompt_rows.shape[0])
        self._open[t.ticket] = t  # before sending: frames may follow the answer at once
        msg = frontend_pb2.FrontendMessage(submit=frontend_pb2.Submit(
            ticket=t.ticket, prompt_rows=rows_matrix(prompt_rows), sampling=sampling, max_frames=max_frames))
        try:
            answer = (await self._call(msg)).submitted
        except BaseException:
            self.abort(t)
            raise
        self._refused(t, answer)
        t.id, t.loaded = answer.request_id, answer.loaded
        return t

    async def submit_canvas(self, model: str, canvas: worker_pb2.CanvasStart) -> CanvasTicket:
        """Queue one canvas on the model's workers; its CanvasDone arrives in the ticket's `done`.
        QueueFull: the core refused it (its queue, or a canvas no worker's budget holds)."""
        t = CanvasTicket(next(self._tickets))
        self._open[t.ticket] = t  # before sending: a refusal's CanvasDone may follow the answer at once
        msg = frontend_pb2.FrontendMessage(canvas_submit=frontend_pb2.CanvasSubmit(
            ticket=t.ticket, model=model, canvas=canvas))
        try:
            answer = (await self._call(msg)).submitted
        except BaseException:
            self.abort(t)
            raise
        self._refused(t, answer)
        t.id = answer.request_id
        return t

    def _refused(self, t: Ticket | CanvasTicket, answer: frontend_pb2.Submitted) -> None:
        """QueueFull or Unavailable when the core did not take the request."""
        if answer.queue_full or answer.unavailable:
            self._open.pop(t.ticket, None)
            if answer.queue_full:
                raise QueueFull(answer.queue_full, answer.retry_after_s)
            raise Unavailable(answer.unavailable)

    def pause(self, t: Ticket, paused: bool) -> None:
        """Its client is not reading (paused): the core stops planning the request until resumed."""
        if t.ticket in self._open:
            self._send(frontend_pb2.FrontendMessage(pause=frontend_pb2.Pause(ticket=t.ticket, paused=paused)))

    def abort(self, t: Ticket | CanvasTicket) -> None:
        """The client went away (or the stream is over): drop the request. Idempotent."""
        if self._open.pop(t.ticket, None) is not None:
            self._send(frontend_pb2.FrontendMessage(abort=frontend_pb2.Abort(ticket=t.ticket)))

    def report(self, event: str, ttfa_s: float = 0.0, outcome: str = "") -> None:
        self._send(frontend_pb2.FrontendMessage(report=frontend_pb2.CallReport(event=event, ttfa_s=ttfa_s,
                                                                             outcome=outcome)))

    def evict_prefix(self, rows: np.ndarray, shared_rows: int) -> None:
        """A deleted voice's prompt prefix: the core frees the cached rows that start with it."""
        self._send(frontend_pb2.FrontendMessage(evict_prefix=frontend_pb2.EvictPrefix(
            rows=rows_matrix(rows), shared_rows=shared_rows)))

    @property
    def broken(self) -> str:
        """Why the link to the core stopped reading (empty while it reads): nothing can be served then."""
        r = self._reader
        if r is None or not r.done() or r.cancelled():
            return ""
        return repr(r.exception())

    def close(self) -> None:
        """Stop; requests still open end UNAVAILABLE."""
        self._fail_open(f"the scheduler core at {self.endpoint} was dropped")
        for task in (self._reader, self._watcher):
            if task:
                task.cancel()
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()

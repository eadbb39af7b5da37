"""A frontend's end of the link to the scheduler core (DEALER -> the core's ROUTER).

What the Synthesize handler needs of the scheduler, over ZeroMQ: submit a
prompt and get a Ticket whose `events` queue receives the request's
FrameEvents and its FinishEvent / ErrorEvent (the same events the audio relay
reads in-process), or submit an OmniVoice canvas and get a CanvasTicket whose
`done` future receives its CanvasDone; abort either; and the voice store that
all frontends share.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from chorus import curve
from chorus.v1 import frontend_pb2, worker_pb2
from scheduler_svc.request import ErrorEvent, FinishEvent, FrameEvent, QueueFull, Unavailable
from chorus.wire import matrix_array, rows_matrix


class CoreUnavailable(RuntimeError):
    pass


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
    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context | None = None, max_message_bytes: int = 0):
        """max_message_bytes: a larger message from the core drops the link (0 = no limit)."""
        self.endpoint = endpoint
        self._sock = (ctx or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.limit_size(self._sock, max_message_bytes)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._calls = itertools.count(1)
        self._tickets = itertools.count(1)
        self._answers: dict[int, asyncio.Future] = {}
        self._open: dict[int, Ticket | CanvasTicket] = {}
        self._reader: asyncio.Task | None = None
        self.hello: frontend_pb2.CoreHello | None = None
        self.down: set[str] = set()            # models none of whose workers answers (the core's WorkerHealth)
        self.health_changed = asyncio.Event()   # set on every WorkerHealth

    # ---- transport ------------------------------------------------------------------------------
    def _send(self, msg: frontend_pb2.FrontendMessage) -> None:
        self._sock.send(msg.SerializeToString())

    async def _call(self, msg: frontend_pb2.FrontendMessage, timeout: float = 30.0) -> frontend_pb2.CoreMessage:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
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
                self.down = set(msg.health.down)
                self.health_changed.set()
                continue
            fut = self._answers.get(msg.call)
            if fut is not None and not fut.done():
                fut.set_result(msg)

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

    # ---- voices ---------------------------------------------------------------------------------
    async def put_voice(self, voice: frontend_pb2.StoredVoice) -> bool:
        """False: the store is full (it holds max_voices others)."""
        return bool((await self._call(frontend_pb2.FrontendMessage(put_voice=voice))).voices.voices)

    async def get_voice(self, voice_id: str, owner: str = "") -> frontend_pb2.StoredVoice | None:
        """The voice_id of this owner (the caller's API key owner), or None."""
        found = (await self._call(frontend_pb2.FrontendMessage(
            get_voice=frontend_pb2.VoiceQuery(voice_id=voice_id, owner=owner)))).voices.voices
        return found[0] if found else None

    async def delete_voice(self, voice_id: str, owner: str = "") -> bool:
        return bool((await self._call(frontend_pb2.FrontendMessage(
            delete_voice=frontend_pb2.VoiceQuery(voice_id=voice_id, owner=owner)))).voices.voices)

    async def list_voices(self, owner: str = "") -> list[frontend_pb2.StoredVoice]:
        return list((await self._call(frontend_pb2.FrontendMessage(
            list_voices=frontend_pb2.VoiceQuery(owner=owner)))).voices.voices)

    @property
    def broken(self) -> str:
        """Why the link to the core stopped reading (empty while it reads): nothing can be served then."""
        r = self._reader
        if r is None or not r.done() or r.cancelled():
            return ""
        return repr(r.exception())

    def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._sock.close()

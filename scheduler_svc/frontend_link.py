"""The core's end of the link to its frontend processes (ROUTER; each frontend a DEALER).

Frontends submit and abort here, and evict a deleted voice's prefix from the radix cache
(voices themselves live in the frontends' store); the scheduler's events come
back through this sink: buffered per frontend while a journal is applied and
sent as one Progress message per frontend at flush(), so a step of 256 frames
costs each frontend one message, not 256. OmniVoice canvases go to the canvas
scheduler of the model they name and come back whole, one CanvasDone each.
Which models have no worker answering, and whether the core drains, goes to every
frontend when it changes (WorkerHealth), and a frontend whose client stops reading
pauses its request.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import zmq
import zmq.asyncio

from chorus import curve
from chorus.v1 import frontend_pb2
from chorus.wire import matrix_array, rows_matrix
from scheduler_svc import metrics
from scheduler_svc.canvas_policy import Canvas, CanvasTooLarge, InvalidCanvas
from scheduler_svc.canvas_scheduler import CanvasScheduler, CanvasSink
from scheduler_svc.model_routing import OMNIVOICE, UnknownModel, resolve_model
from scheduler_svc.request import ErrorEvent, EventSink, FinishEvent, FrameEvent, QueueFull, Request, Unavailable
from scheduler_svc.scheduler import Scheduler

log = logging.getLogger("chorus.scheduler")


class _Outbox:
    """One frontend's share of the current step."""

    def __init__(self):
        self.tickets: list[int] = []
        self.indices: list[int] = []
        self.rows: list[np.ndarray] = []
        self.finished: list[frontend_pb2.Finished] = []


class FrontendLink(EventSink, CanvasSink):
    def __init__(self, endpoint: str, ctx: zmq.asyncio.Context | None = None,
                 max_message_bytes: int = 0, curve_keys: tuple[str, str] | None = None):
        """max_message_bytes: a frontend sending more in one message is disconnected (0 = no limit);
        curve_keys: (the core's secret key file, the directory of allowed frontends' public keys)
        to serve CURVE only; CurveError when they cannot be used."""
        ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.limit_size(self._sock, max_message_bytes)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what exceeds the HWM: never drop frames
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # a frontend on another host that goes silent is dropped after 3 s (ZMTP heartbeats)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        # the authenticator must share the socket's C context (ZAP is per context)
        self._auth = curve.serve(zmq.Context.shadow(ctx.underlying), self._sock, *curve_keys) if curve_keys else None
        self._sock.bind(endpoint)
        self.known: set[bytes] = set()   # frontends that said hello: they get the load every second
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.scheduler: Scheduler | None = None
        self.ready: set[bytes] = set()
        self.ready_changed = asyncio.Event()
        self._origin: dict[int, tuple[bytes, int]] = {}          # request id -> (frontend, ticket)
        self._requests: dict[tuple[bytes, int], Request] = {}     # (frontend, ticket) -> request
        self._out: dict[bytes, _Outbox] = {}
        self.canvas_schedulers: dict[str, list[CanvasScheduler]] = {}  # model name -> one per worker
        self.served: dict[str, str] = {}                            # model name -> architecture
        self.default_model = ""
        self._canvas_origin: dict[Canvas, tuple[bytes, int]] = {}
        self._canvases: dict[tuple[bytes, int], tuple[CanvasScheduler, Canvas]] = {}
        self._late: list[tuple[bytes, frontend_pb2.CoreMessage]] = []  # sent after the current answer
        self._task: asyncio.Task | None = None
        self.draining = ""  # set (why): new requests are refused UNAVAILABLE; the frontends drain too

    def start(self, scheduler: Scheduler, canvas_schedulers: list[CanvasScheduler] = (),
              default_model: str = "") -> None:
        """Serve the frontends. default_model: the served model that requests naming none get (its
        name or architecture; empty: the MOSS model); UnknownModel when it names none."""
        self.scheduler = scheduler
        self.canvas_schedulers = {}
        for s in canvas_schedulers:
            self.canvas_schedulers.setdefault(s.model_name, []).append(s)
        self.served = {scheduler.hello.model_name: scheduler.hello.architecture,
                       **{name: OMNIVOICE for name in self.canvas_schedulers}}
        self.default_model = resolve_model(default_model, self.served)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._serve())
        self._load_task = loop.create_task(self._send_load())

    @property
    def broken(self) -> str:
        """Why the link stopped serving (empty while it serves): the core cannot go on without it."""
        if self._task is None or not self._task.done() or self._task.cancelled():
            return ""
        return repr(self._task.exception())

    def close(self) -> None:
        if self._task:
            self._task.cancel()
            self._load_task.cancel()
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()

    # ---- the scheduler's sink ---------------------------------------------------------------
    def emit(self, req: Request, event: FrameEvent | FinishEvent | ErrorEvent) -> None:
        origin = self._origin.get(req.id)
        if origin is None:
            return  # aborted by its frontend
        frontend, ticket = origin
        box = self._out.get(frontend)
        if box is None:
            box = self._out[frontend] = _Outbox()
        if isinstance(event, FrameEvent):
            box.tickets.append(ticket)
            box.indices.append(event.index)
            box.rows.append(event.row)
            return
        done = frontend_pb2.Finished(ticket=ticket, frames=len(req.frames),
                                     cached_prompt_rows=req.cached_prompt_rows)
        if req.t_scheduled is not None:
            done.queue_ms = (req.t_scheduled - req.t_accepted) * 1e3
        if isinstance(event, FinishEvent):
            done.reason = event.reason
        else:
            done.error, done.unavailable = event.message, event.unavailable
        box.finished.append(done)
        self._forget(req)

    def flush(self) -> None:
        for frontend, box in self._out.items():
            msg = frontend_pb2.CoreMessage()
            p = msg.progress
            if box.rows:
                p.tickets.extend(box.tickets)
                p.indices.extend(box.indices)
                p.rows.CopyFrom(rows_matrix(np.stack(box.rows)))
            p.finished.extend(box.finished)
            self._send(frontend, msg)
        self._out.clear()

    def canvas_done(self, canvas: Canvas) -> None:
        origin = self._canvas_origin.pop(canvas, None)
        if origin is None:
            return  # aborted by its frontend
        self._canvases.pop(origin, None)
        frontend, ticket = origin
        done = frontend_pb2.CanvasDone(ticket=ticket)
        if canvas.codes is not None:
            done.codes.CopyFrom(rows_matrix(canvas.codes))
        else:
            done.error = canvas.error or "the canvas ended without codes"
        if canvas.t_started is not None:
            done.queue_ms = (canvas.t_started - canvas.t_accepted) * 1e3
            if canvas.t_finished is not None:
                done.generate_ms = (canvas.t_finished - canvas.t_started) * 1e3
        self._send(frontend, frontend_pb2.CoreMessage(canvas_done=done))

    def worker_health(self, model: str, up: bool) -> None:
        msg = self._health()
        for frontend in self.ready | self.known:
            self._send(frontend, msg)

    def drain(self, why: str) -> None:
        """Take no new requests (the running and queued ones go on) and tell the frontends, which
        then serve NOT_SERVING and refuse new calls themselves."""
        self.draining = why
        self.worker_health("", True)

    async def _send_load(self) -> None:
        """The health and load to every frontend that said hello, each second: frontend tiers weigh
        engines by it."""
        while True:
            await asyncio.sleep(1.0)
            if self.known:
                msg = self._health()
                for frontend in self.known:
                    self._send(frontend, msg)

    def _health(self) -> frontend_pb2.CoreMessage:
        """The models none of whose workers answers, and the MOSS scheduler's load."""
        down = [name for name, group in self.canvas_schedulers.items() if not any(s.heartbeat.up for s in group)]
        health = frontend_pb2.WorkerHealth(down=down, draining=bool(self.draining))
        if self.scheduler is not None:
            if not self.scheduler.heartbeat.up:
                health.down.insert(0, self.scheduler.hello.model_name)
            health.queued, health.running = len(self.scheduler.policy.waiting), len(self.scheduler.policy.running)
        return frontend_pb2.CoreMessage(health=health)

    def _forget(self, req: Request) -> None:
        origin = self._origin.pop(req.id, None)
        if origin is not None:
            self._requests.pop(origin, None)

    # ---- frontend messages ----------------------------------------------------------------------
    def _send(self, frontend: bytes, msg: frontend_pb2.CoreMessage) -> None:
        self._sock.send_multipart([frontend, msg.SerializeToString()])

    async def _serve(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            try:
                frontend, payload = parts
                msg = frontend_pb2.FrontendMessage.FromString(payload)
                answer = self._handle(frontend, msg)
            except Exception:  # noqa: BLE001 - a bad message must not stop the link
                log.exception("frontend message failed")
                continue
            if answer is not None:
                answer.call = msg.call
                self._send(frontend, answer)
            for late in self._late:
                self._send(*late)
            self._late.clear()

    def _handle(self, frontend: bytes, msg: frontend_pb2.FrontendMessage) -> frontend_pb2.CoreMessage | None:
        kind = msg.WhichOneof("kind")
        if kind == "submit":
            return self._submit(frontend, msg.submit)
        if kind == "canvas_submit":
            return self._canvas_submit(frontend, msg.canvas_submit)
        if kind == "abort":
            req = self._requests.get((frontend, msg.abort.ticket))
            if req is not None:
                self._forget(req)
                self.scheduler.abort(req)
            held = self._canvases.pop((frontend, msg.abort.ticket), None)
            if held is not None:
                scheduler, canvas = held
                self._canvas_origin.pop(canvas, None)
                scheduler.cancel(canvas)
            return None
        if kind == "pause":
            req = self._requests.get((frontend, msg.pause.ticket))
            if req is not None:
                self.scheduler.pause(req, msg.pause.paused)
            return None
        if kind == "report":
            self._report(frontend, msg.report)
            return None
        if kind == "hello":
            self.known.add(frontend)
            self._late.append((frontend, self._health()))
            s = self.scheduler
            return frontend_pb2.CoreMessage(hello=frontend_pb2.CoreHello(
                worker=s.hello, kv_pages=s.kv.num_pages, page_size=s.kv.page_size,
                canvas_workers=[c.hello for group in self.canvas_schedulers.values() for c in group],
                default_model=self.default_model))
        if kind == "evict_prefix":
            freed = self.scheduler.evict_prefix(matrix_array(msg.evict_prefix.rows), msg.evict_prefix.shared_rows)
            log.info("a deleted voice's prefix: %d cached rows freed", freed)
            return None
        raise ValueError(f"unknown frontend message {kind!r}")

    def _submit(self, frontend: bytes, sub: frontend_pb2.Submit) -> frontend_pb2.CoreMessage:
        if self.draining:
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, unavailable=self.draining))
        req = Request(prompt_rows=matrix_array(sub.prompt_rows), sampling=sub.sampling, max_frames=sub.max_frames)
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, queue_full=str(e),
                                                                             retry_after_s=e.retry_after))
        except Unavailable as e:
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, unavailable=str(e)))
        self._origin[req.id] = (frontend, sub.ticket)
        self._requests[(frontend, sub.ticket)] = req
        return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, request_id=req.id,
                                                                         loaded=self.scheduler.loaded))

    def _canvas_submit(self, frontend: bytes, sub: frontend_pb2.CanvasSubmit) -> frontend_pb2.CoreMessage:
        """Queue a canvas on its model's least loaded scheduler that takes it: Submitted now (queue_full
        set when none does), the CanvasDone when it ends. A model that takes no canvases, or a malformed
        canvas, is answered by a CanvasDone error."""
        if self.draining:
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, unavailable=self.draining))
        try:
            name = resolve_model(sub.model, self.served, self.default_model)
            group = self.canvas_schedulers.get(name)
            if group is None:
                raise UnknownModel(f"model {name!r} is not an OmniVoice model; OmniVoice models served: "
                                   f"{', '.join(self.canvas_schedulers) or '(none)'}")
            scheduler, canvas = _submit_to_one(sorted(group, key=lambda s: s.load), sub.canvas)
        except (QueueFull, CanvasTooLarge) as e:
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, queue_full=str(e)))
        except Unavailable as e:
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, unavailable=str(e)))
        except (UnknownModel, InvalidCanvas) as e:
            self._late.append((frontend, frontend_pb2.CoreMessage(canvas_done=frontend_pb2.CanvasDone(
                ticket=sub.ticket, error=str(e)))))
            return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket))
        self._canvas_origin[canvas] = (frontend, sub.ticket)
        self._canvases[(frontend, sub.ticket)] = (scheduler, canvas)
        return frontend_pb2.CoreMessage(submitted=frontend_pb2.Submitted(ticket=sub.ticket, request_id=canvas.id))

    def _report(self, frontend: bytes, r: frontend_pb2.CallReport) -> None:
        if r.event == "ready":
            self.ready.add(frontend)
            self.ready_changed.set()
        elif r.event == "start":
            metrics.ACTIVE_STREAMS.inc()
        elif r.event == "first_audio":
            metrics.TTFA_SECONDS.observe(r.ttfa_s)
        elif r.event == "refused":
            metrics.CALLER_REFUSALS.labels(r.outcome).inc()
        elif r.event == "end":
            metrics.ACTIVE_STREAMS.dec()
            if r.outcome:
                metrics.REQUESTS.labels(r.outcome).inc()


def _submit_to_one(schedulers: list[CanvasScheduler], start) -> tuple[CanvasScheduler, Canvas]:
    """The first of `schedulers` whose worker answers that accepts the canvas, and the canvas; else the
    first refusal (Unavailable when no worker answers)."""
    refusal = None
    for s in sorted(schedulers, key=lambda s: not s.heartbeat.up):
        try:
            return s, s.submit(start)
        except (QueueFull, CanvasTooLarge) as e:
            refusal = refusal or e
        except Unavailable as e:
            refusal = e if refusal is None or isinstance(refusal, Unavailable) else refusal
    raise refusal

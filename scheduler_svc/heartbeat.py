"""Is the worker there? One watcher per worker link, shared by the MOSS and OmniVoice drivers.

Two signals, because a worker busy with a long step answers nothing until the step is done:
- the link's own connection: ZeroMQ reports the TCP (or ipc) connection to the worker closing the
  moment its process dies, busy or not;
- hello probes every `interval` seconds while no step is out, and at once when a connection opens: an idle worker that does not answer
  within `timeout` is stuck or gone (a stuck busy one is ended by its own stall watchdog, which
  closes the connection).
The watcher flips `up` and calls `changed(up)` on each flip; `down` is an Event the drivers wait on
beside a step's journal, so a step out on a dead worker is given up at once, not after its timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from scheduler_svc.worker_client import WorkerClient

log = logging.getLogger("chorus.scheduler")


class Heartbeat:
    def __init__(self, worker: WorkerClient, name: str, interval: float, timeout: float,
                 busy: Callable[[], bool], changed: Callable[[bool], None] = lambda up: None):
        """busy: whether a step is out (its hello would wait behind the step, so silence means nothing)."""
        self.worker = worker
        self.name = name
        self.interval = interval
        self.timeout = max(timeout, interval)
        self.busy = busy
        self.changed = changed
        self.up = True
        self.why = ""                 # why it is down
        self.down = asyncio.Event()   # set while down
        self.alive = asyncio.Event()  # set while up
        self.alive.set()
        self.last_hello = None  # the newest Hello a probe got back
        self._poke = asyncio.Event()  # a connection opened: probe now, not at the next interval
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        if self.interval <= 0:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._probe()), loop.create_task(self._watch_connection())]

    def stop(self) -> None:
        for t in self._tasks:
            t.cancel()

    def mark(self, up: bool, why: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            self.down.clear()
            self.alive.set()
            log.warning("the %s worker at %s answers again", self.name, self.worker.endpoint)
        else:
            self.why = why
            self.alive.clear()
            self.down.set()
            log.error("the %s worker at %s is gone: %s", self.name, self.worker.endpoint, why)
        self.changed(up)

    async def wake_or_down(self, wakeup: asyncio.Event) -> None:
        """Wait until wakeup is set (a scheduler's new work) or the worker is found gone."""
        tasks = [asyncio.ensure_future(wakeup.wait()), asyncio.ensure_future(self.down.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()

    async def new_incarnation(self, known: int, timeout: float) -> int | None:
        """The incarnation of a new worker process answering hello within `timeout`, or None when
        nothing answers or the process the driver knows (`known`) does (alive, busy or stuck)."""
        try:
            hello = await self.worker.hello(timeout=timeout)
        except Exception:  # noqa: BLE001 - no answer
            return None
        self.mark(True)
        return hello.incarnation if is_new_worker(known, hello.incarnation) else None

    async def _probe(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poke.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()
            if self.busy() and self.up:
                continue
            try:
                self.last_hello = await self.worker.hello(timeout=self.timeout)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - no answer
                if not self.busy():
                    self.mark(False, f"no answer to hello within {self.timeout:g} s")
                continue
            self.mark(True)

    async def _watch_connection(self) -> None:
        monitor = self.worker.monitor()
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self.mark(False, "its connection closed")
                elif event == zmq.EVENT_CONNECTED and not self.up:
                    self._poke.set()
        finally:
            monitor.close()


def is_new_worker(known: int, incarnation: int) -> bool:
    """Does this incarnation (from a Hello or a Journal) belong to another worker process than the
    known one? (0: a worker that does not say.)"""
    return bool(incarnation and known and incarnation != known)

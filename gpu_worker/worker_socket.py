"""The worker's ROUTER socket, as every model's worker serves it: CURVE and the message-size limit
from the config, the endpoint bound (a :0 port picks a free one), and the stop flag that ends the
serving loop between commands.

SIGINT or SIGTERM drains: a scheduler draining its requests (it got SIGTERM at the same moment, in
the same pod) still needs steps, so the worker serves on until no scheduler is connected or
drain_seconds have passed (or a second signal comes), then `stopping` turns true."""

from __future__ import annotations

import logging
import signal
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from chorus import curve
from gpu_worker.config import WorkerConfig

log = logging.getLogger("chorus.worker")


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind; an endpoint ending in :0 takes a free port. Returns the endpoint bound."""
    if endpoint.endswith(":0"):
        host = endpoint.rsplit(":", 1)[0]
        return f"{host}:{sock.bind_to_random_port(host)}"
    sock.bind(endpoint)
    return endpoint


class WorkerSocket:
    def __init__(self, args: WorkerConfig):
        self.ctx = zmq.Context()
        try:
            self.sock, self.auth = curve.router(self.ctx, args.curve_secret_key, args.curve_clients,
                                                args.max_message_bytes)
        except curve.CurveError as e:
            raise SystemExit(f"worker: {e}") from None
        self.endpoint = bind(self.sock, args.bind)
        curve.warn_if_open(self.endpoint, self.auth)
        # peers connect only after the bind returns: watching from here counts every one
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.peers = 0
        self.drain_seconds = args.drain_seconds
        self._deadline: float | None = None
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, *_) -> None:
        """The first signal drains; a second one (Ctrl-C again) stops at once."""
        now = time.monotonic()
        self._deadline = now + self.drain_seconds if self._deadline is None else now

    @property
    def stopping(self) -> bool:
        """Signalled, and no scheduler is connected or the drain time is over."""
        while self._monitor.poll(0):  # read as they come: the monitor's queue is bounded
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            self.peers += 1 if event == zmq.EVENT_ACCEPTED else -1
        if self._deadline is None:
            return False
        if self.peers <= 0:
            log.info("draining: no scheduler connected; stopping")
            return True
        if time.monotonic() >= self._deadline:
            log.warning("draining: %d connections still open after %g s; stopping", self.peers, self.drain_seconds)
            return True
        return False

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close()
        self.sock.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        log.info("worker stopped")

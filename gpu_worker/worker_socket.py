"""The worker's ROUTER socket, as every model's worker serves it: CURVE and the message-size limit
from the config, the endpoint bound (a :0 port picks a free one), and a stop flag that SIGINT and
SIGTERM set so the serving loop ends between commands."""

from __future__ import annotations

import logging
import signal

import zmq

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
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, *_) -> None:
        self.stopping = True

    def close(self) -> None:
        self.sock.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        log.info("worker stopped")

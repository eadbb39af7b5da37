"""Bounded audio for clients that read slowly or not at all.

A frontend holds the audio it has not yet handed to gRPC (the client's HTTP/2 window is full).
Each stream may hold `per_stream` bytes, the whole frontend `per_frontend` (beyond it, every stream
holding some waits, so one that holds none can still start). A stream over its share stops
reading its vocoder stream, which backs the vocoder up through gRPC, and pauses its request at
the scheduler core (no decode steps; a MOSS request keeps its KV): the frontend decides, because
only it sees the client's socket, and the core stops planning, because only it spends the GPU.
A stream paused with nothing delivered for `stall` seconds ends (ReaderStalled).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class ReaderStalled(Exception):
    pass


class Backlog:
    """One frontend's undelivered audio."""

    def __init__(self, per_stream: int, per_frontend: int, stall: float):
        self.per_stream = per_stream
        self.per_frontend = per_frontend
        self.stall = stall
        self.total = 0
        self._changed = asyncio.Event()

    def stream(self, pause: Callable[[bool], None] = lambda paused: None) -> "StreamBacklog":
        return StreamBacklog(self, pause)

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # waiters hold the one just set


class StreamBacklog:
    """One stream's undelivered audio; `pause(paused)` tells its request's scheduler."""

    def __init__(self, backlog: Backlog, pause: Callable[[bool], None]):
        self.backlog = backlog
        self.pause = pause
        self.bytes = 0
        self.closed = False
        self.last_delivery = time.monotonic()

    def add(self, n: int) -> None:
        if self.closed:
            return
        self.bytes += n
        self.backlog.total += n

    def delivered(self, n: int) -> None:
        n = min(n, self.bytes)
        self.bytes -= n
        self.backlog.total -= n
        self.last_delivery = time.monotonic()
        self.backlog._pulse()

    def close(self) -> None:
        """The stream ended: what it still holds no longer counts. Idempotent."""
        if self.bytes:
            self.delivered(self.bytes)
        self.closed = True

    def full(self) -> bool:
        b = self.backlog
        return self.bytes > b.per_stream or (b.total > b.per_frontend and self.bytes > 0)

    async def room(self) -> None:
        """Wait until this stream may take more audio, its request paused meanwhile. ReaderStalled when
        its client reads nothing for `stall` seconds."""
        if not self.full():
            return
        self.pause(True)
        stall = self.backlog.stall
        try:
            while self.full():
                waited = time.monotonic() - self.last_delivery
                if stall and waited >= stall:
                    raise ReaderStalled(f"the client read no audio for {waited:.0f} s while {self.bytes} bytes "
                                        f"waited (reader_stall {stall:g} s); the stream was cancelled")
                try:
                    await asyncio.wait_for(self.backlog._changed.wait(), min(1.0, stall - waited) if stall else 1.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.pause(False)

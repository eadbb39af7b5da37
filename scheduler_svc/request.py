"""A request as the scheduler sees it, and the events it produces."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import numpy as np

from chorus.v1 import worker_pb2
from scheduler_svc.radix_cache import RadixNode


class QueueFull(RuntimeError):
    """Refused for now (RESOURCE_EXHAUSTED); retry_after: seconds after which a retry should fit (0: unknown)."""

    def __init__(self, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(RuntimeError):
    """The model's worker is gone: the request is refused now (UNAVAILABLE) instead of waiting for it."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class FrameEvent:
    index: int
    row: np.ndarray  # [1 + n_vq] int32


@dataclass
class FinishEvent:
    reason: str  # "stop" | "max_frames"


@dataclass
class ErrorEvent:
    message: str
    unavailable: bool = False  # the worker is gone: the client may retry (UNAVAILABLE, not INTERNAL)


Event = FrameEvent | FinishEvent | ErrorEvent


@dataclass(eq=False)  # identity: requests are compared as objects, never by value
class Request:
    prompt_rows: np.ndarray            # [T, 1 + n_vq] int32
    sampling: worker_pb2.SamplingConfig
    max_frames: int
    id: int = 0
    phase: Phase = Phase.WAITING
    frames: list[np.ndarray] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # radix key of every row: prompt, then frames
    # KV of the current admission
    kv_slots: list[int] = field(default_factory=list)  # slot of row p at index p (+ spare tail)
    prefix_node: RadixNode | None = None  # locked radix match
    cached_len: int = 0                # rows served by the cache (slots owned by the cache)
    prefill_len: int = 0               # rows to prefill in this admission
    rows_sent: int = 0                 # rows whose KV write has been planned
    rows_written: int = 0              # rows whose KV write has been journaled
    frames_planned: int = 0            # frames the worker will have sampled once in-flight steps land
    holds_worker_state: bool = False
    paused: bool = False               # its client is not reading: no decode steps until it is resumed
    # reporting
    cached_prompt_rows: int = 0
    retractions: int = 0
    finish_reason: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_accepted: float = field(default_factory=time.monotonic)
    t_scheduled: float | None = None

    @property
    def prompt_len(self) -> int:
        return self.prompt_rows.shape[0]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the sequence prompt + frames."""
        t = self.prompt_len
        parts = []
        if start < t:
            parts.append(self.prompt_rows[start:min(stop, t)])
        if stop > t:
            parts.append(np.stack(self.frames[max(start, t) - t:stop - t]))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]


class EventSink:
    """Where the scheduler's request events go. This one puts them on each request's own
    queue (in-process consumers: tests, benchmarks); the core's FrontendLink batches them
    into one message per frontend per step, sent at flush()."""

    def emit(self, req: Request, event: Event) -> None:
        req.events.put_nowait(event)

    def flush(self) -> None:
        pass

    def worker_health(self, model: str, up: bool) -> None:
        """The model's worker stopped answering (up False) or answers again."""

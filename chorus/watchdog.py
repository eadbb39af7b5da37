"""A process that stops making progress on its device must end, not linger.

On the H200 a GPU hang (twice so far: graphs sharing a cuBLAS workspace while replaying
concurrently) left the worker and the vocoder alive, bound to their ports and answering health
checks, while no step ever finished: every client waited for its timeout. StallWatchdog ends the
process instead, so its supervisor (Kubernetes, `chorus up`) restarts it and the scheduler fails
over to another replica.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger("chorus.watchdog")

STALL_EXIT_CODE = 72  # the process ended itself: device work stopped finishing
CUDA_STALL_S = 120.0  # no step takes near this long once warmed up (kernel compiles happen before serving)


def stall_exit_setting(work: str):
    """The stall_exit_s config field for a service whose device runs `work` (e.g. "a launched step")."""
    from chorus.config import setting
    return setting(None, f"end the process (exit code {STALL_EXIT_CODE}) when {work} has not finished after "
                   f"this many seconds (unset: {CUDA_STALL_S:.0f} on CUDA, off elsewhere; 0 = off)", metavar="S",
                   minimum=0)


def stall_limit(flag: float | None, device_type: str) -> float:
    """The stall_exit_s setting, or its default for the device type."""
    if flag is not None:
        return flag
    return CUDA_STALL_S if device_type == "cuda" else 0.0


def _exit(message: str) -> None:
    log.critical(message)
    print(message, flush=True)
    os._exit(STALL_EXIT_CODE)


class StallWatchdog:
    """Device work is begun and ended in order (steps finish in launch order); when the oldest
    unfinished piece is older than `limit_s`, `on_stall` gets a message (default: log it and end
    the process with STALL_EXIT_CODE). limit_s <= 0 turns it off."""

    def __init__(self, limit_s: float, what: str, on_stall: Callable[[str], None] = _exit):
        self.limit_s, self.what, self._on_stall = limit_s, what, on_stall
        self._open: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()
        self._fired = False
        if limit_s > 0:
            threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()

    def begin(self) -> None:
        if self.limit_s > 0:
            with self._lock:
                self._open.append(time.monotonic())

    def end(self) -> None:
        if self.limit_s > 0:
            with self._lock:
                if self._open:
                    self._open.popleft()

    def _watch(self) -> None:
        period = min(1.0, self.limit_s / 4)
        while not self._fired:
            time.sleep(period)
            with self._lock:
                age = time.monotonic() - self._open[0] if self._open else 0.0
            if age > self.limit_s:
                self._fired = True
                self._on_stall(f"{self.what} has not finished in {age:.0f} s (limit {self.limit_s:.0f} s): the "
                               f"device is stuck; ending the process so that it is restarted")
